"""Where a row becomes prompt ids: reading inputs, SGLang's chat-path normalization, chat
templates and tokenizers, pooled templating, server rendering, and turn splitting."""
