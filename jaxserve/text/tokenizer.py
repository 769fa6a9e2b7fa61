"""Text <-> token ids for one model directory: encode, chat templates, decode, stop ids.

A thin wrapper over transformers' fast tokenizer, loaded from local files only (never downloads).
Host side: no jax here, and it does not run on the engine thread.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxserve.text.generation_config import eos_token_ids

KNOWN_ROLES = frozenset({"system", "user", "assistant", "tool"})


class ChatTemplateUnavailable(RuntimeError):
    """Rendering failed for a reason that is not the messages' fault (a missing module such as
    jinja2, a template that does not compile, a bug): a server error, never a client error."""


class Tokenizer:
    """Encode/decode and chat-template rendering for one Hugging Face model directory."""

    def __init__(self, hf_tokenizer: Any, generation_eos_ids: Iterable[int] = ()) -> None:
        if not getattr(hf_tokenizer, "is_fast", False):
            raise ValueError("jaxserve needs a fast (tokenizers-backed) tokenizer")
        self.hf = hf_tokenizer
        eos = set(int(i) for i in generation_eos_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self._eos_token_ids = frozenset(eos)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "Tokenizer":
        """Load the tokenizer files of a local model directory (no network access)."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        path = Path(model_dir)
        if not path.is_dir():
            raise ValueError(f"model directory {str(path)!r} does not exist")
        loader = PreTrainedTokenizerFast if _loads_as_written(path) else AutoTokenizer
        hf = loader.from_pretrained(str(path), local_files_only=True)
        return cls(hf, eos_token_ids(path))

    # ------------------------------------------------------------ properties

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the tokenizer's eos plus generation_config.json's eos_token_id."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (ids are 0..vocab_size-1).

        This can be smaller than the model's embedding rows (`config.json` vocab_size), which are
        often padded.
        """
        return len(self.hf)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of all special tokens: the named ones (eos, pad, ...) and added tokens marked special."""
        ids = set(self.hf.all_special_ids)
        ids.update(i for i, t in self.hf.added_tokens_decoder.items() if t.special)
        return sorted(ids)

    def added_vocab(self) -> dict[str, int]:
        """Added tokens, content -> id: strings the tokenizer matches whole, before its model runs."""
        return dict(self.hf.get_added_vocab())

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def with_chat_template(self, template: str) -> "Tokenizer":
        """This tokenizer rendering chats with `template` (Jinja) instead of the model's own; this
        one is left as it was (it may be shared)."""
        hf = copy.copy(self.hf)
        hf.chat_template = template
        return Tokenizer(hf, self._eos_token_ids)

    # ------------------------------------------------------------ operations

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        # verbose=False: transformers warns "Token indices sequence length is longer than the specified
        # maximum sequence length" past tokenizer_config's model_max_length, which is not our limit
        # (max_model_len is; the server refuses an over-long prompt with a line of its own).
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens, verbose=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(token_ids)))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render `messages` with the model's chat template and encode the result.

        Each message needs a known `role` (system, user, assistant, tool) and a `content` that is a
        str or a list of `{"type": "text", "text": ...}` parts (joined). An assistant message that
        carries `tool_calls` may have `content` None. Extra keyword arguments reach the template.
        Raises ValueError for messages the template rejects, ChatTemplateUnavailable when rendering
        fails for any other reason.
        """
        if not self.has_chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json has no 'chat_template')")
        normalized = _validate_messages(messages)
        try:
            text = self.hf.apply_chat_template(
                normalized, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
        except Exception as e:
            if _caused_by_input(e):
                raise ValueError(f"chat template failed: {e}") from e
            raise ChatTemplateUnavailable(f"the chat template could not be rendered ({type(e).__name__}: {e}); "
                                          "this is a server problem, not a problem with the request") from e
        # The template already wrote every special token it wants: no BOS again unless asked
        # (/tokenize's add_special_tokens, as vLLM's)
        return self.encode(text, add_special_tokens=add_special_tokens)


# Tokenizer classes that transformers rebuilds from tokenizer.json (its vocabulary and merges parsed
# by Python's json: ~0.7 s of a warm start, holding the GIL) into what the file already describes:
# loaded through the generic fast tokenizer instead, which reads the file in Rust. tests/
# test_tokenizer.py checks that both give the same ids, text, special tokens and chat rendering.
_SAME_AS_TOKENIZER_JSON = frozenset({"Qwen2Tokenizer", "Qwen2TokenizerFast"})


def _loads_as_written(path: Path) -> bool:
    config = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not config.is_file():
        return False
    return json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class") in _SAME_AS_TOKENIZER_JSON


def read_chat_template(text: str) -> str:
    """`--chat-template`: a file's path, or the template itself (vLLM takes both); a template that
    does not compile is refused here, before the model loads."""
    import jinja2

    path = Path(text).expanduser()
    template = path.read_text(encoding="utf-8") if path.is_file() else text
    if template is text and "{{" not in text and "{%" not in text:
        raise ValueError(f"--chat-template {text!r}: no such file, and not a Jinja template either")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: the template does not compile (line {e.lineno}: {e.message})") from None
    return template


def _caused_by_input(error: Exception) -> bool:
    """Whether a rendering error is the messages' fault: the template rejected them (its
    raise_exception(), an undefined field) or met values of the wrong type. A missing module
    (transformers raises ImportError without jinja2) or a template that does not compile is not."""
    if isinstance(error, (TypeError, ValueError, LookupError)):
        return True
    try:
        from jinja2.exceptions import TemplateError, TemplateSyntaxError
    except ImportError:
        return False
    return isinstance(error, TemplateError) and not isinstance(error, TemplateSyntaxError)


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"messages[{i}] has no 'role'")
        role = m["role"]
        if role not in KNOWN_ROLES:
            raise ValueError(f"messages[{i}] has unknown role {role!r}; expected one of {sorted(KNOWN_ROLES)}")
        if "content" not in m:
            raise ValueError(f"messages[{i}] has no 'content'")
        msg = dict(m)
        msg["content"] = _content_text(m["content"], i, allow_none=role == "assistant" and bool(m.get("tool_calls")))
        out.append(msg)
    return out


def _content_text(content: Any, i: int, allow_none: bool) -> str | None:
    if isinstance(content, str):
        return content
    if content is None:
        if allow_none:
            return None
        raise ValueError(f"messages[{i}].content is null")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': str}}")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}")


def check_same_vocabulary(target_dir: Path, draft_dir: Path) -> None:
    """Raises ValueError when both directories carry a tokenizer.json whose token -> id maps
    differ (a speculative draft's ids must mean the target's tokens). Directories without one
    (orbax-converted weights without tokenizer files) are left to the vocab-size check."""
    files = [Path(d) / "tokenizer.json" for d in (target_dir, draft_dir)]
    if not all(f.is_file() for f in files):
        return
    target, draft = (_token_ids(json.loads(f.read_text(encoding="utf-8"))) for f in files)
    if target != draft:
        differ = sorted(set(target.items()) ^ set(draft.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(f"--speculative-config draft model {draft_dir} has another vocabulary than the target "
                         f"{target_dir} ({len(draft)} vs {len(target)} tokens; e.g. {differ}): a draft must use the "
                         "target's tokenizer")


def _token_ids(spec: dict) -> dict[str, int]:
    """token -> id of a tokenizer.json: the model's vocabulary (a map, or Unigram's [piece, score]
    list) and the added tokens."""
    vocab = spec.get("model", {}).get("vocab") or {}
    ids = dict(vocab) if isinstance(vocab, dict) else {piece: i for i, (piece, _) in enumerate(vocab)}
    ids.update({t["content"]: t["id"] for t in spec.get("added_tokens", [])})
    return ids
