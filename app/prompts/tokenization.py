"""Client-side chat templating: local tokenizer loading, prompt ids, reasoning split.

The folder's hashes are `app.prompts.tokenizer_files`; what its config files say is
`app.prompts.tokenizer_config`. transformers is imported lazily inside functions, so importing
this module is cheap.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from app.core.contracts import Message
from app.core.errors import InputError, TokenizerError
from app.core.images import ImagePins
from app.core.logs import quiet_transformers
from app.ledger import pin_checks
from app.prompts.chat_path import (
    ChatInputs,
    ContentFormat,
    bare_function_tools,
    final_assistant_as_user,
    normalize_messages,
    normalize_tools,
    template_view,
)
from app.prompts.chat_pins import check_file_unchanged, choice_of, rendered_on_server
from app.prompts.image_pins import read_image_pins
from app.prompts.placeholders import check_placeholders, image_placeholders
from app.prompts.template_choice import ChosenTemplate, TemplateChoice, choose_template
from app.prompts.template_reading import detect_content_format, template_may_reorder_tool_results
from app.prompts.tokenizer_config import (
    context_length_of,
    custom_code_class,
    default_template,
    eos_token_ids_of,
    renders_with_dsv32_encoder,
    single_token_id,
)
from app.prompts.tokenizer_files import (
    legacy_tokenizer_files_hash,
    manifest_hash,
    tokenizer_files_manifest,
)
from app.prompts.tokenizer_loading import check_faithful, load_as_sglang
from app.prompts.transformers_pin import TransformersPin, as_server_renders, transformers_pin

logger = logging.getLogger(__name__)

THINK_START = "<think>"
THINK_END = "</think>"

# apply_chat_template arguments tokenmill sets itself; a template kwarg with one of these
# names would change what is produced (or clash with the call), so it is refused.
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "tools",
    }
)


_FAILED = "chat template failed: "


def load_tokenizer(
    path: str | Path,
    *,
    trust_remote_code: bool = False,
    template: TemplateChoice | None = None,
    pass_turn_fields: bool = False,
    server_renders: bool = False,
) -> ChatTokenizer:
    """Load a tokenizer from a local folder (never the hub) as SGLang loads it, check that it is
    faithful to its files, and choose its chat template as SGLang does
    (`app.prompts.tokenizer_loading`, `app.prompts.template_choice`).

    The folder is resolved to an absolute path (runs store it, and later commands may run
    from another folder). A folder whose tokenizer is its own Python code (`auto_map` in
    tokenizer_config.json) loads only with trust_remote_code; without it the error names
    `--trust-remote-code`. pass_turn_fields: turns keep every field when rendered.
    server_renders: the run's server renders its prompts (`--render-with`), so a folder with
    no chat template loads (and renders nothing here: `require_local_template`).
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        raise TokenizerError(f"tokenizer path {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise TokenizerError(f"tokenizer path {str(folder)!r} is not a folder")
    folder = folder.resolve()
    custom = custom_code_class(folder)
    if custom is not None and not trust_remote_code:
        raise TokenizerError(
            f"the tokenizer in {str(folder)!r} is custom code ({custom}, from the folder's "
            "own Python files): pass --trust-remote-code to run it, once you trust that code"
        )
    try:
        quiet_transformers()
        tokenizer = load_as_sglang(folder, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise TokenizerError(f"could not load the tokenizer in {str(folder)!r}: {exc}") from exc
    check_faithful(tokenizer, folder)
    chosen = choose_template(
        getattr(tokenizer, "chat_template", None),
        template or TemplateChoice(),
        folder,
        server_renders=server_renders,
    )
    if not chosen.on_server:
        tokenizer.chat_template = chosen.text  # as SGLang's TemplateManager overwrites it
    chat = ChatTokenizer(
        tokenizer,
        folder,
        trust_remote_code=trust_remote_code,
        template=chosen,
        pass_turn_fields=pass_turn_fields,
    )
    logger.info(
        "loaded tokenizer %s (tokenizer %s, template %s, %s)",
        folder,
        chat.tokenizer_hash[:12],
        chat.chat_template_hash[:12],
        "fast" if chat.is_fast else "slow: templated in parallel processes",
        extra={"action": "tokenizer_loaded"},
    )
    return chat


def load_for_run(
    path: str | Path, *, trust_remote_code: bool, chat_pins: Mapping[str, Any] | None
) -> ChatTokenizer:
    """load_tokenizer with the template choice and --pass-turn-fields a run pinned; a pinned
    --chat-template file that changed since is a TokenizerError."""
    choice, pass_turn_fields = choice_of(chat_pins)
    tokenizer = load_tokenizer(
        path,
        trust_remote_code=trust_remote_code,
        template=choice,
        pass_turn_fields=pass_turn_fields,
        server_renders=rendered_on_server(chat_pins),
    )
    check_file_unchanged(chat_pins, tokenizer.template)
    return tokenizer


class ChatTokenizer:
    """A Hugging Face tokenizer with its chat template, as the producer and exporter use it.

    `apply` gives the prompt ids SGLang's chat path makes: the turns normalized as
    `app.prompts.chat_path` does, rendered to text with the tools and kwargs and the generation
    prompt, and encoded without adding special tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        path: Path,
        *,
        trust_remote_code: bool = False,
        template: ChosenTemplate | None = None,
        pass_turn_fields: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._path = path
        self._trust_remote_code = trust_remote_code
        self._tokenizer_files = tokenizer_files_manifest(path)
        self._tokenizer_hash = manifest_hash(self._tokenizer_files)
        self._legacy_hash = legacy_tokenizer_files_hash(path)
        if template is None:
            text = tokenizer.chat_template
            chosen = default_template(text) if not isinstance(text, str) else text
            template = ChosenTemplate(chosen or "", chosen or "")
        self._chosen = template
        self._chat_template_hash = template.sha256
        self._pass_turn_fields = pass_turn_fields
        self._pin: TransformersPin | None = None
        self._single_ids: dict[str, int | None] = {}
        self._think_start_id = single_token_id(tokenizer, THINK_START)
        self._think_end_id = single_token_id(tokenizer, THINK_END)
        self._eos_token_ids = eos_token_ids_of(tokenizer, path)
        self._context_length = context_length_of(tokenizer, path)
        self._content_format = detect_content_format(template.detect_from)
        self._placeholders = image_placeholders(tokenizer)
        pins = read_image_pins(path, tokenizer)
        self._image_pins = pins if isinstance(pins, ImagePins) else None
        self._no_image_pins = pins if isinstance(pins, str) else ""

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped transformers tokenizer."""
        return self._tokenizer

    @property
    def path(self) -> Path:
        return self._path

    @property
    def trust_remote_code(self) -> bool:
        """Whether the folder's own Python code was allowed to run when it was loaded."""
        return self._trust_remote_code

    @property
    def is_fast(self) -> bool:
        """A Rust ("fast") tokenizer; a slow one is templated in parallel processes."""
        return bool(getattr(self._tokenizer, "is_fast", False))

    @property
    def tokenizer_hash(self) -> str:
        """sha256 over the names and contents of every file of the folder but weights."""
        return self._tokenizer_hash

    @property
    def tokenizer_files(self) -> dict[str, str]:
        """sha256 of each hashed file, by its path in the folder (the run pins these)."""
        return dict(self._tokenizer_files)

    @property
    def legacy_hash(self) -> str:
        """The hash runs created before the per-file manifest pinned (fewer files)."""
        return self._legacy_hash

    def changes_from(self, pinned_hash: str, pinned_files: Mapping[str, str] | None) -> list[str]:
        """Lines naming each file that differs from what a run pinned (none if it matches)."""
        return pin_checks.file_changes(
            pinned_hash,
            pinned_files,
            self._tokenizer_hash,
            self._tokenizer_files,
            self._legacy_hash,
        )

    @property
    def chat_template_hash(self) -> str:
        """sha256 of the chat template text rendered with (the chosen one of named templates,
        or the --chat-template file as SGLang reads it)."""
        return self._chat_template_hash

    @property
    def template(self) -> ChosenTemplate:
        """The chosen template and what the run pins about it."""
        return self._chosen

    @property
    def pass_turn_fields(self) -> bool:
        """Turns keep every field (`--pass-turn-fields`), not only those SGLang keeps."""
        return self._pass_turn_fields

    def transformers_pin(self) -> TransformersPin:
        """The transformers version rendered with and the server's it renders as;
        ConfigurationError naming both when they cannot agree (checked at the first render)."""
        if self._pin is None:
            self._pin = transformers_pin()
        return self._pin

    @property
    def think_start_id(self) -> int | None:
        return self._think_start_id

    def single_token_id(self, text: str) -> int | None:
        """The id of text when it is one added/special token that stays one id in context."""
        if text not in self._single_ids:
            self._single_ids[text] = single_token_id(self._tokenizer, text)
        return self._single_ids[text]

    @property
    def think_end_id(self) -> int | None:
        """Id of `</think>` when it is one added/special token, else None."""
        return self._think_end_id

    @property
    def eos_token_ids(self) -> list[int]:
        """The tokenizer's eos id, then any from generation_config.json, without repeats."""
        return list(self._eos_token_ids)

    @property
    def context_length(self) -> int | None:
        return self._context_length

    @property
    def content_format(self) -> ContentFormat:
        """How the template takes list content: "string" (parts joined) or "openai" (kept),
        detected from the template as SGLang detects it."""
        return self._content_format

    @property
    def image_pins(self) -> ImagePins | None:
        """The image placeholder the folder names (a multimodal model's), or None."""
        return self._image_pins

    @property
    def no_image_pins(self) -> str:
        """Why image_pins is None (an image row is refused with it); "" when it is not."""
        return self._no_image_pins

    @property
    def renders_every_tool(self) -> bool:
        """Whether the server renders every tool of a request whatever tool a named tool_choice
        picks: SGLang's DeepSeek-V3.2 encoder path does (`request.tools` when the choice leaves
        any), its Jinja path and its other encoders render the chosen one."""
        has_template = getattr(self._tokenizer, "chat_template", None) is not None
        return self._chosen.on_server and renders_with_dsv32_encoder(self._path, has_template)

    @property
    def reorders_tool_results(self) -> bool:
        """Whether SGLang puts tool results in call order before rendering with this template
        (it reads tool_call_id); unknown, so yes, for a template only the server has."""
        return template_may_reorder_tool_results(
            None if self._chosen.on_server else self._chosen.text
        )

    @property
    def renders_locally(self) -> bool:
        """Whether the folder (or --chat-template) gave a template to render with here."""
        return not self._chosen.on_server

    def require_local_template(self, what: str) -> None:
        """TokenizerError saying that `what` needs a local chat template, which this folder
        lacks (its run is rendered by the server), and naming --chat-template."""
        if self._chosen.on_server:
            raise TokenizerError(
                f"{what} needs a local chat template, and the tokenizer in "
                f"{str(self._path)!r} has none (its prompts are rendered by the server): give "
                "the server's template with --chat-template FILE"
            )

    def render(
        self,
        messages: Sequence[Message],
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text SGLang's chat path makes of these turns, tools and template kwargs,
        generation prompt included (the turns and tools are normalized first:
        `app.prompts.chat_path`).
        """
        self.require_local_template("rendering a prompt on the client")
        inputs = ChatInputs(list(messages), list(tools) if tools else None, chat_template_kwargs)
        return self._render(*self._prepared(inputs))

    def apply(
        self,
        messages: Sequence[Message],
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt ids: `render`, then encoded without adding special tokens, as SGLang does."""
        return self._encode([self.render(messages, chat_template_kwargs, tools)])[0]

    def apply_batch(
        self,
        conversations: Sequence[Sequence[Message]],
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[list[int]]:
        """`apply` for many conversations sharing kwargs and tools: the same ids, faster.

        The texts are encoded in one batched call (on all cores for a fast tokenizer). If the
        template fails on a conversation, the InputError names its index in the batch; use
        `apply_each` to keep the others.
        """
        _template_kwargs(chat_template_kwargs)  # a bad shared kwarg is the caller's error
        shared = list(tools) if tools else None
        batch = [ChatInputs(list(c), shared, chat_template_kwargs) for c in conversations]
        results = self.apply_each(batch)
        for index, result in enumerate(results):
            if isinstance(result, InputError):
                reason = result.reason.removeprefix(_FAILED)
                raise InputError(
                    f"chat template failed on conversation {index} of the batch: {reason}"
                )
        return [ids for ids in results if not isinstance(ids, InputError)]

    def apply_each(self, batch: Sequence[ChatInputs]) -> list[list[int] | InputError]:
        """Prompt ids for each entry (its own turns, tools and kwargs), or the InputError of
        an entry that cannot be normalized or rendered (its kwargs included); the texts are
        encoded in one call."""
        self.require_local_template("rendering a prompt on the client")
        self.transformers_pin()  # the whole batch is refused, not each entry
        texts: list[str | InputError] = []
        for inputs in batch:
            try:
                texts.append(self._render(*self._prepared(inputs)))
            except InputError as exc:
                texts.append(exc)
            except TokenizerError as exc:  # this entry's kwargs
                texts.append(InputError(str(exc)))
            except Exception as exc:  # nothing one entry holds may stop the others
                texts.append(InputError(f"cannot build the prompt: {type(exc).__name__}: {exc}"))
        rendered = [text for text in texts if isinstance(text, str)]
        encoded = iter(self._encode_each(rendered) if rendered else [])
        out = [text if isinstance(text, InputError) else next(encoded) for text in texts]
        for index, inputs in enumerate(batch):
            ids = out[index]
            if inputs.assistant_prefix and not isinstance(ids, InputError):
                out[index] = self._continued(ids, inputs.assistant_prefix)
        return out

    def _continued(self, ids: list[int], prefix: str) -> list[int] | InputError:
        """ids with a continued turn's text appended, or why that cannot be done here: for a
        tokenizer declaring a response template, a server running a response-template
        reasoning parser puts its answer opener before the text, which only it knows."""
        declared = getattr(self._tokenizer, "response_template", None)
        if not isinstance(declared, dict):
            declared = (getattr(self._tokenizer, "init_kwargs", None) or {}).get(
                "response_template"
            )
        if isinstance(declared, dict):
            return InputError(
                "continue_final_message: the tokenizer declares a response_template, so a server "
                "with a response-template reasoning parser opens the answer before the continued "
                "text, which only the server renders; use --render-with (or --no-request-fields)"
            )
        return ids + self._prefix_ids(prefix)

    def _prefix_ids(self, prefix: str) -> list[int]:
        """A continued turn's ids as SGLang appends them: encoded with the tokenizer's own
        special tokens, then a leading BOS dropped (`_append_assistant_prefix_to_prompt_ids`)."""
        ids = [int(i) for i in self._tokenizer.encode(prefix)]
        if ids and ids[0] == self._tokenizer.bos_token_id:
            ids = ids[1:]
        return ids

    def _encode_each(self, texts: list[str]) -> list[list[int] | InputError]:
        """`_encode`, or when the batch fails, each text on its own (its error its own)."""
        try:
            return list(self._encode(texts))
        except Exception:
            logger.debug("batch encode failed; encoding %d prompts one by one", len(texts))
        out: list[list[int] | InputError] = []
        for text in texts:
            try:
                out.append(self._encode([text])[0])
            except Exception as exc:
                out.append(InputError(f"the tokenizer cannot encode the prompt: {exc}"))
        return out

    def _prepared(
        self, inputs: ChatInputs
    ) -> tuple[list[Message], list[dict[str, Any]] | None, dict[str, Any]]:
        kwargs = _template_kwargs(inputs.chat_template_kwargs)
        if inputs.normalized:
            turns, tools = list(inputs.messages), inputs.tools or None
        else:
            turns = normalize_messages(
                inputs.messages, self._content_format, pass_turn_fields=self._pass_turn_fields
            )
            tools = normalize_tools(inputs.tools) if inputs.tools else None
        check_placeholders(self._placeholders, turns, tools)
        # a boundary after two answers in a row ends with an answer: SGLang sends it as a
        # user turn (a request without continue_final_message; with it, the continued turn
        # is the one left out, and the answer before it stays an answer)
        if inputs.assistant_prefix is None:
            turns = final_assistant_as_user(turns)
        return template_view(turns), tools or None, kwargs

    def _render(
        self, turns: list[Message], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> str:
        # SGLang retries once with bare function tools whatever failed; the template's own
        # first error says what is wrong, the retry's only when the tools were the matter
        try:
            return self._template(turns, tools, kwargs)
        except Exception as exc:
            first = exc
        if not tools:
            raise InputError(f"{_FAILED}{first}") from first
        try:
            return self._template(turns, bare_function_tools(tools), kwargs)
        except Exception as exc:
            raise InputError(f"{_FAILED}{first} (and with bare function tools: {exc})") from first

    def _template(
        self, turns: list[Message], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> str:
        with as_server_renders():
            text = self._tokenizer.apply_chat_template(
                turns, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
            )
        return str(text)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Rendered prompts to ids without adding special tokens (the template has them)."""
        if len(texts) == 1:
            return [[int(i) for i in self._tokenizer.encode(texts[0], add_special_tokens=False)]]
        encoded = self._tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [[int(i) for i in ids] for ids in encoded]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def split_reasoning(
    output_ids: Sequence[int], think_end_id: int | None, *, think_start_id: int | None = None
) -> tuple[list[int] | None, list[int]]:
    """Split generated ids at the FIRST `</think>` id: (reasoning, answer), the tag in neither.

    The first one, because the model closes its reasoning once; a later `</think>` id belongs
    to the answer. With no `</think>` id (or think_end_id None) the result is (None, all ids):
    the caller decides what an unterminated reasoning means. If think_start_id is given and
    the output begins with it (models whose template does not supply `<think>`), it is dropped
    from the reasoning. Trailing eos ids stay in the answer. Never a string search.
    """
    ids = list(output_ids)
    if think_end_id is None:
        return None, ids
    try:
        end = ids.index(think_end_id)
    except ValueError:
        return None, ids
    reasoning = ids[:end]
    if think_start_id is not None and reasoning[:1] == [think_start_id]:
        reasoning = reasoning[1:]
    return reasoning, ids[end + 1 :]


def check_template_kwargs(chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The kwargs as a dict; TokenizerError for a non-object or a name tokenmill sets itself."""
    return _template_kwargs(chat_template_kwargs)


def _template_kwargs(chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping):
        raise TokenizerError(
            "chat template kwargs must be a JSON object (a dict) such as "
            f'{{"thinking": false}}, not {type(chat_template_kwargs).__name__}'
        )
    kwargs = dict(chat_template_kwargs)
    for key in kwargs:
        if not isinstance(key, str):
            raise TokenizerError(f"chat template kwarg names must be strings, not {key!r}")
        if key in _RESERVED_KWARGS:
            raise TokenizerError(
                f"chat template kwarg {key!r} is not allowed: tokenmill sets it itself"
            )
    return kwargs
