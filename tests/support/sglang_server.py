"""SGLang 0.5.23's own server-side prompt path, run from its wheel's source with the GPU stack
stubbed: the oracle the deployment-exact tests compare tokenmill's prompts with.

Taken from the wheel, by their source: `get_tokenizer` and its post-load fixes
(`utils/hf_transformers/tokenizer.py`, with the helpers it uses from `common.py`),
`TemplateManager` (`parser/template_manager.py`: named templates, `--chat-template FILE`,
content format), and from `OpenAIServingChat` (`entrypoints/openai/serving_chat.py`) the
methods a `/v1/tokenize` chat request runs through: `_validate_request`, `_process_messages`,
`_apply_jinja_template`, `_render_and_encode_chat_template` and their helpers, with
`OpenAIServingTokenize._tokenize_chat_request` on top; the request models are protocol.py's
(`tests.support.sglang_contract.load_protocol`). What is stubbed is only what a text-only
Jinja model never reaches: remote loaders, GGUF, mistral-common, tool/reasoning parsers,
Python templates, model-path conversation templates. Nothing here imports tokenmill.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
import logging
import os
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.support.sglang_chat_path import _member, serving_chat_functions, template_utils
from tests.support.sglang_contract import load_protocol

TOKENIZER_MEMBER = "sglang/srt/utils/hf_transformers/tokenizer.py"
COMMON_MEMBER = "sglang/srt/utils/hf_transformers/common.py"
PATCH_MEMBER = "sglang/srt/utils/patch_tokenizer.py"
TEMPLATE_MANAGER_MEMBER = "sglang/srt/parser/template_manager.py"
SCHEMA_MEMBER = "sglang/srt/function_call/utils.py"
SERVING_CHAT_MEMBER = "sglang/srt/entrypoints/openai/serving_chat.py"
SERVING_TOKENIZE_MEMBER = "sglang/srt/entrypoints/openai/serving_tokenize.py"
CHAT_ENCODING_MEMBER = "sglang/srt/entrypoints/openai/chat_encoding.py"
DSV32_MEMBER = "sglang/srt/entrypoints/openai/encoding_dsv32.py"

CHAT_METHODS = (
    "_validate_request",
    "_validate_media_content",
    "_effective_tools",
    "_process_messages",
    "_apply_jinja_template",
    "_render_and_encode_chat_template",
    "_handle_last_assistant_message",
    "_canonicalize_tool_message_order",
    "_sort_tool_message_run",
    "_probe_prompt_text_round_trip",
    "_append_assistant_prefix_to_prompt_ids",
    "_thinking_requested",
)
logger = logging.getLogger("sglang-oracle")


def _definitions(member: str, names: tuple[str, ...], namespace: dict[str, Any]) -> None:
    """Run the top-level definitions `names` of a wheel file (functions, classes, constants)
    in namespace, without the file's imports."""
    tree = ast.parse(_member(member))
    body: list[ast.stmt] = []
    for node in tree.body:
        name = None
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            name = node.name
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        if name in names:
            body.append(node)
    found = {
        getattr(n, "name", None)
        or getattr(getattr(n, "target", None), "id", None)
        or n.targets[0].id  # type: ignore[attr-defined]
        for n in body
    }
    missing = set(names) - found
    assert not missing, f"{member} has no {missing}"
    exec(compile(ast.Module(body=body, type_ignores=[]), member, "exec"), namespace)


def _methods(member: str, cls: str, names: tuple[str, ...], namespace: dict[str, Any]) -> type:
    """A class holding only the methods `names` of class `cls` in a wheel file."""
    tree = ast.parse(_member(member))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    wanted = [
        n
        for n in node.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name in names
    ]
    assert {n.name for n in wanted} == set(names), f"{cls} lacks some of {names}"
    for method in wanted:  # properties and static methods keep their decorators
        method.decorator_list = [
            d for d in method.decorator_list if isinstance(d, ast.Name) and d.id == "staticmethod"
        ]
    klass = ast.ClassDef(name=cls, bases=[], keywords=[], body=wanted, decorator_list=[])
    module = ast.Module(body=[klass], type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), member, "exec"), namespace)
    return namespace[cls]  # type: ignore[no-any-return]


@functools.cache
def _tokenizer_namespace() -> dict[str, Any]:
    import transformers
    from transformers import AutoTokenizer, PreTrainedTokenizer, PreTrainedTokenizerFast

    namespace: dict[str, Any] = {
        "json": json,
        "logging": logging,
        "warnings": __import__("warnings"),
        "Path": Path,
        "Optional": Any,
        "Union": Any,
        "AutoTokenizer": AutoTokenizer,
        "PreTrainedTokenizer": PreTrainedTokenizer,
        "PreTrainedTokenizerFast": PreTrainedTokenizerFast,
        "transformers": transformers,
        "logger": logger,
        # remote and GGUF checkpoints, mistral-common: never a local Jinja tokenizer folder
        "create_remote_connector": None,
        "is_remote_url": lambda name: False,
        "_ensure_gguf_version": lambda: None,
        "check_gguf_file": lambda name: False,
        "gguf_sidecar_dir": lambda name, file: None,
        "resolve_runai_obj_uri": lambda name: name,
        "build_gguf_tokenizer": None,
        "has_native_gguf_support": lambda name: False,
        "_MISTRAL_TOKENIZER_REDIRECTS": {},
        "is_bare_tekken_checkpoint": lambda name, revision: False,
        "patch_mistral_common_tokenizer": lambda tokenizer: None,
        "retry_without_mistral_common_kwargs": None,
        # patch_tokenizer reads one switch of sglang's environment: its default, on
        "envs": SimpleNamespace(SGLANG_PATCH_TOKENIZER=SimpleNamespace(get=lambda: True)),
        "inspect": __import__("inspect"),
    }
    _definitions(
        COMMON_MEMBER,
        (
            "_resolve_local_or_cached_file",
            "_ADDITIONAL_STOP_TOKEN_TEXTS",
            "attach_additional_stop_token_ids",
        ),
        namespace,
    )
    _definitions(
        PATCH_MEMBER,
        (
            "patch_tokenizer",
            "_is_kimi_tiktoken_tokenizer",
            "_needs_pad_padding_side_shim",
            "_PadPaddingSideShim",
            "_SpecialTokensCachePatcher",
            "_make_cached_property",
        ),
        namespace,
    )
    tree = ast.parse(_member(TOKENIZER_MEMBER))
    names = tuple(
        n.name if isinstance(n, ast.FunctionDef | ast.ClassDef) else n.targets[0].id  # type: ignore[attr-defined]
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.ClassDef)
        or (isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name))
    )
    _definitions(TOKENIZER_MEMBER, names, namespace)
    return namespace


def get_tokenizer(folder: Path, *, trust_remote_code: bool = False) -> Any:
    """SGLang's get_tokenizer on a local folder."""
    return _tokenizer_namespace()["get_tokenizer"](
        str(folder), tokenizer_mode="auto", trust_remote_code=trust_remote_code
    )


def _template_manager_class(hf_chat_template_name: str | None) -> type:
    utils = template_utils()
    namespace: dict[str, Any] = {
        "json": json,
        "os": __import__("os"),
        "logger": logger,
        "Dict": Any,
        "Optional": Any,
        "TokenizerManager": Any,
        "PythonChatTemplate": Any,
        "detect_jinja_template_content_format": utils.detect_jinja_template_content_format,
        "jinja_template_may_reorder_tool_results": utils.jinja_template_may_reorder_tool_results,
        "get_serving": lambda: SimpleNamespace(hf_chat_template_name=hf_chat_template_name),
        # text-only fixture folders: no built-in conversation template matches their path,
        # no GLM-5.3 Python template applies
        "chat_template_exists": lambda name: False,
        "get_python_chat_template": lambda name: None,
        "get_conv_template_by_model_path": lambda path: None,
        "resolve_python_chat_template": lambda config, template: None,
        "detect_reasoning_pattern": lambda template: (False, None),
        "build_detection_context": lambda *args: None,
    }
    _definitions(TEMPLATE_MANAGER_MEMBER, ("TemplateManager",), namespace)
    return namespace["TemplateManager"]  # type: ignore[no-any-return]


@functools.cache
def _schema_namespace() -> dict[str, Any]:
    namespace: dict[str, Any] = {"Any": Any, "Dict": dict, "List": list, "Tuple": tuple}
    names = (
        "_STANDARD_JSON_SCHEMA_TYPES",
        "_JSON_SCHEMA_TYPE_ALIASES",
        "_PREFIX_BOUNDARY_CHARS",
        "_PREFIX_RULES",
        "_matches_type_prefix",
        "_normalize_single_type",
        "_normalize_type_list",
        "normalize_json_schema_types",
    )
    _definitions(SCHEMA_MEMBER, names, namespace)
    return namespace


@functools.cache
def _wheel_module(member: str) -> Any:
    """A self-contained module of the wheel (standard-library imports only), loaded by path."""
    import importlib.util

    from tests.support.sglang_contract import CACHE_DIR, SGLANG_VERSION

    path = CACHE_DIR / f"{Path(member).stem}-{SGLANG_VERSION}.py"
    if not path.exists():
        path.write_text(_member(member), encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"sglang_{Path(member).stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_config(folder: Path) -> SimpleNamespace:
    """The architectures and model type of the folder's config.json (none without one)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    return SimpleNamespace(
        architectures=list(config.get("architectures") or []),
        model_type=config.get("model_type"),
    )


# the encoders this oracle runs: the Jinja path (None) and DeepSeek-V3.2's Python encoder
SUPPORTED_ENCODINGS = (None, "dsv32")


class SGLangServer:
    """One SGLang 0.5.23 server's /v1/tokenize for a tokenizer folder, as the server starts it
    with `--hf-chat-template-name` / `--chat-template` when given."""

    def __init__(
        self,
        folder: Path,
        *,
        chat_template_name: str | None = None,
        chat_template_file: str | None = None,
        trust_remote_code: bool = False,
        multimodal: bool = False,
    ) -> None:
        import jinja2
        import orjson
        from jsonschema import Draft202012Validator, SchemaError

        protocol = load_protocol()
        self.protocol = protocol
        tokenizer = get_tokenizer(folder, trust_remote_code=trust_remote_code)
        self.tokenizer = tokenizer
        config = hf_config(folder)
        tokenizer_manager = SimpleNamespace(
            tokenizer=tokenizer,
            processor=None,
            model_config=SimpleNamespace(
                hf_config=SimpleNamespace(architectures=[]), is_multimodal=multimodal
            ),
            served_model_name="default",
        )
        manager = _template_manager_class(chat_template_name)()
        manager.load_chat_template(tokenizer_manager, chat_template_file, str(folder))
        # SGLang's own dispatch: DeepseekV3 architectures without a chat template -> "dsv32"
        encoding = _wheel_module(CHAT_ENCODING_MEMBER).resolve_chat_encoding_spec(
            hf_config=config, tokenizer=tokenizer
        )
        if encoding not in SUPPORTED_ENCODINGS:
            raise NotImplementedError(f"the oracle does not run the {encoding!r} encoder")
        self.encoding = encoding
        functions = serving_chat_functions()
        utils = template_utils()
        namespace: dict[str, Any] = {
            **{name: getattr(protocol, name) for name in dir(protocol) if name[:1].isupper()},
            "copy": copy,
            "orjson": orjson,
            "logger": logger,
            "Any": Any,
            "List": list,
            "Dict": dict,
            "Optional": Any,
            "jinja2": jinja2,
            "Draft202012Validator": Draft202012Validator,
            "SchemaError": SchemaError,
            "_CHAT_TEMPLATE_CLIENT_ERRORS": (jinja2.TemplateError, TypeError),
            "normalize_json_schema_types": _schema_namespace()["normalize_json_schema_types"],
            "process_content_for_template_format": utils.process_content_for_template_format,
            "MEDIA_URL_PART_TYPES": utils.MEDIA_URL_PART_TYPES,
            "normalize_assistant_tool_call_arguments": functions[
                "normalize_assistant_tool_call_arguments"
            ],
            "normalize_tool_content": functions["normalize_tool_content"],
            "get_serving": lambda: SimpleNamespace(
                trust_request_chat_template=False, allow_auto_truncate=False
            ),
            "get_model": lambda: SimpleNamespace(context_length=None),
            # the documented contract of parallel_prompt_encode: tokenizer.encode's ids
            "parallel_prompt_encode": lambda tok, text, kwargs: tok.encode(text, **kwargs),
            "normalize_hunyuan_reasoning_effort": lambda *args: None,
            "ThinkingMode": SimpleNamespace(THINKING="thinking", CHAT="chat"),
            "MessageProcessingResult": _Result,
            "encoding_dsv32": _wheel_module(DSV32_MEMBER),
            # the decoding constraint of a required or named tool_choice: not the prompt's
            "get_json_schema_constraint": lambda *args, **kwargs: {},
            # SGLANG_DEFAULT_THINKING's default (environ.py: EnvBool(False))
            "envs": SimpleNamespace(SGLANG_DEFAULT_THINKING=SimpleNamespace(get=lambda: False)),
            # a server without a reasoning parser has no response-template detector
            "ResponseTemplateReasoningDetector": type("NoDetector", (), {}),
        }
        _definitions(SERVING_CHAT_MEMBER, ("_MEDIA_CONTENT_PART_TYPES",), namespace)
        chat_class = _methods(SERVING_CHAT_MEMBER, "OpenAIServingChat", CHAT_METHODS, namespace)
        chat = chat_class()
        chat.tokenizer_manager = tokenizer_manager
        chat.template_manager = manager
        # a server started without tool-call or reasoning parsers, chat-encoding specs, or
        # default template kwargs: the Jinja path alone
        chat.tool_call_parser = None
        chat.reasoning_parser = None
        chat.default_chat_template_kwargs = {}
        chat.is_minimax_m3 = chat.is_gpt_oss = chat.is_gemma4 = False
        chat.chat_encoding_spec = encoding
        chat._encoding_adapter = None
        chat._reasoning_detector = None
        chat._chat_template_cache = OrderedDict()
        chat._patch_reasoning_skip_special_tokens = lambda request: None
        chat._get_reasoning_from_request = lambda request: False
        chat._encode_messages = lambda *args, **kwargs: None
        chat._takes_turn_grammar = lambda *args, **kwargs: False
        chat._requires_response_template_detokenization = lambda request: False
        try:
            chat._tokenizer_auto_adds_specials = len(tokenizer.encode("")) > 0
        except Exception:
            chat._tokenizer_auto_adds_specials = True
        chat._prompt_text_round_trip_is_lossy = chat._probe_prompt_text_round_trip()
        self.chat = chat
        self.template_manager = manager
        self.multimodal = multimodal

    def tokenize(self, body: dict[str, Any]) -> list[int] | str:
        """The prompt ids of a /v1/tokenize chat body, or the error text of its 400: the body
        parsed with orjson, validated by TokenizeRequest (by ChatCompletionRequest when it has
        a tool_choice, which only a chat completion takes, or holds CHAT_COMPLETION: the body
        of a chat completion), then handled as the server does."""
        import orjson
        from pydantic import ValidationError

        try:
            parsed = orjson.loads(json.dumps(body))
        except (orjson.JSONDecodeError, ValueError) as exc:
            return f"invalid JSON body: {exc}"
        except UnicodeEncodeError as exc:
            return f"invalid JSON body: {exc}"
        try:
            if parsed.pop(CHAT_COMPLETION, False) or "tool_choice" in parsed:
                chat_request = self.protocol.ChatCompletionRequest.model_validate(parsed)
            else:
                request = self.protocol.TokenizeRequest.model_validate(parsed)
                chat_request = request.to_chat_completion_request()
        except ValidationError as exc:
            return f"invalid request: {exc}"
        error = self.chat._validate_request(chat_request)
        if error:
            return str(error)
        try:
            result = self.chat._process_messages(chat_request, self.multimodal)
        except ValueError as exc:
            return str(exc)
        except Exception as exc:  # a 500 at the server: still a refusal
            return f"internal error: {exc}"
        return [int(i) for i in result.prompt_ids]


# a body holding this key (true) is validated as /v1/chat/completions validates its request
CHAT_COMPLETION = "__chat_completion__"


class _Result(SimpleNamespace):
    """Stands in for sglang's MessageProcessingResult dataclass (fields by keyword)."""


# transformers 5.19.0, the version SGLang 0.5.23 pins, installed apart from the venv's
# (`make transformers-519`): the oracle runs with it when the tests run under another version
TRANSFORMERS_519 = Path(__file__).resolve().parents[2] / ".cache" / "transformers-5.19.0"


def tokenize_as_deployed(
    folder: Path, bodies: list[dict[str, Any]], **server: Any
) -> list[list[int] | str]:
    """SGLangServer(folder, **server).tokenize of each body under transformers 5.19.0: here
    when that is the version installed, else in a process that has TRANSFORMERS_519 first on
    its path (server: chat_template_name, chat_template_file, trust_remote_code)."""
    import subprocess
    import sys

    import transformers

    if transformers.__version__ == "5.19.0":
        instance = SGLangServer(folder, **server)
        return [instance.tokenize(body) for body in bodies]
    if not (TRANSFORMERS_519 / "transformers").is_dir():
        raise RuntimeError(
            f"transformers 5.19.0 is not in {TRANSFORMERS_519}: run `make transformers-519`"
        )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{TRANSFORMERS_519}{os.pathsep}{root}"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.sglang_server", str(folder)],
        input=json.dumps({"bodies": bodies, "server": server}),
        capture_output=True,
        text=True,
        env=env,
        check=False,
        cwd=root,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the 5.19.0 oracle failed: {result.stderr[-3000:]}")
    return list(json.loads(result.stdout))


if __name__ == "__main__":
    import sys

    import transformers

    assert transformers.__version__ == "5.19.0", transformers.__version__
    given = json.loads(sys.stdin.read())
    answers = tokenize_as_deployed(Path(sys.argv[1]), given["bodies"], **given["server"])
    print(json.dumps(answers))
