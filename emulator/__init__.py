"""The SGLang emulator: an SGLang-0.5.23-compatible server for machines without a GPU.

`config` holds the flags, `model` the deterministic outputs, `scheduler` batching, `server` HTTP;
images (--mm): `vision` the token counts, `image_data` loading, `image_prompt` the expansion.
"""
