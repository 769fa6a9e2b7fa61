"""The checkpoint's own MTP layer as the proposer (`{"method": "mtp"}`, issue 43) on a tiny DeepSeek-V3
and a tiny GLM-4.5 written by transformers, each MTP layer (`model.layers.3.*`) a fourth decoder
layer of the model's kind that transformers wrote too, beside random enorm / hnorm / eh_proj /
shared_head norms:

- every proposal equals a PyTorch recomputation: transformers' decoder layer (latent attention, MoE)
  over [enorm(embed(next token)) ; hnorm(target residual)] through eh_proj, transformers' own hidden
  states and lm_head, further drafts fed the layer's own output (the oracle of which target state the
  head reads, of the one-token shift and of the chain), and the head's logits equal its values;
- outputs are token-for-token those of plain decoding, greedy and seeded, with acceptance counted, and
  nothing compiles after warm-up;
- a model without MTP layers, or a checkpoint without the layer's tensors, is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoints import load_model
from engine_utils import greedy, make_core, record_proposals, run_all
from hf_models import make_hf_model
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.parallel.sharding import make_mesh

K = 2


def _spec(path: Path) -> dict:
    return {"method": "mtp", "model": str(path), "num_speculative_tokens": K}


def _requests(tag: str) -> list[Request]:
    return [Request(f"{tag}rep", [5, 17, 33, 8] * 3 + [5], greedy(14)),
            Request(f"{tag}plain", [40, 3, 77, 12, 9], greedy(12)),
            Request(f"{tag}long", list(range(3, 45)), greedy(8))]  # a 42-token prefill in 2 chunks


def _write_mtp_layer(variant: str, path: Path, tmp: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Appends an MTP layer to the checkpoint in `path`: layer 3 of a 4-layer model of the same
    variant that transformers writes (its layout on disk: one tensor per expert), already named
    model.layers.3, and the head's own norms and projection. Returns transformers' module of that
    layer and the extra tensors (torch)."""
    from safetensors.numpy import load_file, save_file

    _, donor = make_hf_model(variant, tmp / "donor", seed=3, num_hidden_layers=4)
    stored = load_file(str(tmp / "donor" / "model.safetensors"))
    layer = {k: v for k, v in stored.items() if k.startswith("model.layers.3.")}
    rng = np.random.default_rng(7)
    d = donor.config.hidden_size
    extra = {"enorm.weight": 1 + 0.1 * rng.standard_normal(d), "hnorm.weight": 1 + 0.1 * rng.standard_normal(d),
             "eh_proj.weight": 0.1 * rng.standard_normal((d, 2 * d)),
             "shared_head.norm.weight": 1 + 0.1 * rng.standard_normal(d)}
    extra = {k: v.astype(np.float32) for k, v in extra.items()}
    # the copies of the model's embeddings and lm_head a published checkpoint carries (not read)
    copies = {"embed_tokens.weight": stored["model.embed_tokens.weight"], "shared_head.head.weight": stored["lm_head.weight"]}
    save_file({**layer, **{f"model.layers.3.{k}": v for k, v in {**extra, **copies}.items()}},
              str(path / "mtp.safetensors"))
    return donor.model.layers[3], {k: torch.tensor(v) for k, v in extra.items()}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _target_residual(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' residual stream after the target's last layer [n, D] (before its final norm)."""
    seen = {}
    hook = hf.model.layers[-1].register_forward_hook(lambda m, i, o: seen.setdefault("h", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        hf(torch.tensor([tokens]))
    hook.remove()
    return seen["h"][0]


def reference_rows(hf, layer, extra, rows_tok: list[int], rows_h: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over rows at positions 0..T-1 (row p: the token after p, a residual), in PyTorch:
    (outputs [T, D], logits [T, V])."""
    eps = hf.config.rms_norm_eps
    with torch.no_grad():
        t = len(rows_tok)
        positions = torch.arange(t)[None]
        e = hf.model.embed_tokens(torch.tensor([rows_tok]))[0]
        e[0] = 0.0  # the row at position 0
        x = torch.cat([_rms(e, extra["enorm.weight"], eps), _rms(torch.stack(rows_h), extra["hnorm.weight"], eps)], -1)
        x = (x @ extra["eh_proj.weight"].T)[None]
        mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=hf.model.rotary_emb(x, positions))
        out = (out[0] if isinstance(out, tuple) else out)[0]
        return out, hf.lm_head(_rms(out, extra["shared_head.norm.weight"], eps))[:, :hf.config.vocab_size]


def reference_drafts(hf, layer, extra, tokens: list[int], k: int) -> list[int]:
    """The head's k drafts after `tokens`: row p (p < n - 1) reads the target's residual at p and
    the token at p + 1; each draft is appended as a row at the next position that reads the
    previous row's output."""
    rows_tok, rows_h = list(tokens[1:]), list(_target_residual(hf, tokens)[:len(tokens) - 1])
    drafts = []
    for _ in range(k):
        out, logits = reference_rows(hf, layer, extra, rows_tok, rows_h)
        drafts.append(int(torch.argmax(logits[-1])))
        rows_tok.append(drafts[-1])
        rows_h.append(out[-1])
    return drafts


@pytest.fixture(scope="module")
def deepseek(request, tmp_path_factory):
    """A variant with an MTP layer (DeepSeek-V3 unless a test asks for GLM-4.5), its plain engine and
    greedy outputs."""
    variant = getattr(request, "param", "deepseek_v3")
    tmp = tmp_path_factory.mktemp("mtp")
    path, hf = make_hf_model(variant, tmp / "model")
    layer, extra = _write_mtp_layer(variant, path, tmp)
    cfg, weights = load_model(path, make_mesh(1, 1))  # the decoder alone: the MTP layer is not read
    plain = make_core(cfg, weights, max_model_len=64)
    return path, cfg, weights, hf, layer, extra, plain, run_all(plain, _requests("r"))


BOTH = pytest.mark.parametrize("deepseek", ["deepseek_v3", "glm4_moe"], indirect=True)


@BOTH
def test_the_heads_logits_and_the_residual_it_reads_equal_transformers(deepseek):
    """Values, not only argmaxes: the target's residual after its last layer (the forward's aux
    output the head reads) and the head's logits at every row of a 27-token prompt."""
    import jax.numpy as jnp

    from checkpoints.mtp import load_mtp
    from jaxserve.model import mtp
    from jaxserve.model.dense import dense_attention
    from jaxserve.model.transformer import forward, lm_head, norm

    path, cfg, weights, hf, layer, extra, *_ = deepseek
    head_cfg, head = load_mtp(path, cfg, make_mesh(1, 1))
    tokens = list(range(3, 30))
    n = len(tokens)

    def attend(i, q, k, v, cache, sinks=None):  # causal attention over the rows given
        return dense_attention(q[None], k[None], v[None], jnp.ones((1, q.shape[0]), bool), None, cfg.scale)[0], cache

    _, _, residual = forward(weights, cfg, jnp.asarray(tokens), jnp.arange(n), attend, [None] * cfg.num_layers,
                             aux_layers=(cfg.num_layers,))
    want_residual = _target_residual(hf, tokens)
    np.testing.assert_allclose(np.asarray(residual), want_residual.numpy(), rtol=1e-4, atol=1e-4)
    out, _ = mtp.forward(head, head_cfg, weights.embed, jnp.asarray(tokens[1:]), jnp.arange(n - 1), residual[:n - 1],
                         attend, None, jnp.arange(n - 1), combine=True)
    logits = lm_head(weights, norm(head_cfg.layer, out, head.final_norm))[:, :cfg.vocab_size]
    _, want = reference_rows(hf, layer, extra, tokens[1:], list(want_residual[:n - 1]))
    np.testing.assert_allclose(np.asarray(logits), want.numpy(), rtol=1e-4, atol=1e-4)


@BOTH
def test_proposals_equal_the_torch_oracle_and_outputs_equal_plain_decoding(deepseek):
    path, cfg, weights, hf, layer, extra, _, expected = deepseek
    core = make_core(cfg, weights, max_model_len=64, speculative_config=_spec(path))
    seen = record_proposals(core)
    assert run_all(core, _requests("r")) == expected
    prompts = {r.request_id: r.prompt_token_ids for r in _requests("r")}
    for seq_id, start, drafts in seen:
        rid = seq_id.split("#")[0]
        known = (prompts[rid] + expected[rid][0])[:start + 1]  # through the decode's last token
        assert drafts == reference_drafts(hf, layer, extra, known, len(drafts)), (seq_id, start)
    assert len(seen) >= 10 and {s for s, _, _ in seen} == {"rrep#0", "rplain#0", "rlong#0"}
    stats = core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and len(stats.accepted_per_position) == K
    assert core.runner.compilations_after_warmup == 0
    assert core.allocator.num_free_pages == core.allocator.num_pages


def test_seeded_sampling_and_n_equal_plain_decoding(deepseek):
    path, cfg, weights, _, _, _, plain, _ = deepseek

    def events(core):
        sp = lambda i, **kw: SamplingParams(temperature=0.8, seed=40 + i, max_tokens=12, ignore_eos=True, **kw)  # noqa: E731
        for r in [Request("topk", [5, 17, 33, 8] * 2, sp(0, top_k=4, logprobs=2)),
                  Request("n2", [9, 9, 9, 4], sp(1, n=2, top_p=0.9))]:
            core.add_request(r)
        out = {}
        while core.has_work():
            for e in core.step():
                out.setdefault((e.request_id, e.sample_index), []).append(
                    (e.token_id, None if e.logprob is None else round(e.logprob, 4)))
        return out

    core = make_core(cfg, weights, max_model_len=64, speculative_config=_spec(path))
    assert events(core) == events(plain)
    assert core.scheduler.spec_stats.num_draft_tokens > 0
    assert core.runner.compilations_after_warmup == 0


def test_models_and_checkpoints_without_an_mtp_layer_are_refused_by_name(deepseek, tmp_path):
    path, cfg, weights, *_ = deepseek
    llama, _ = make_hf_model("llama3-gqa-tied", tmp_path / "llama")
    llama_cfg, llama_weights = load_model(llama, make_mesh(1, 1))
    with pytest.raises(ValueError, match="method 'mtp' needs a checkpoint with MTP layers"):
        make_core(llama_cfg, llama_weights, speculative_config=_spec(llama))
    bare, _ = make_hf_model("deepseek_v3", tmp_path / "bare")  # no model.layers.3.*
    with pytest.raises(ValueError, match=r"no complete MTP layer \(model.layers.3"):
        make_core(cfg, weights, speculative_config=_spec(bare))


def test_serving_reads_the_mtp_layer_from_the_served_checkpoint(deepseek):
    """vLLM's shape, `{"method": "mtp", "num_speculative_tokens": k}` with no directory: the engine
    loader (serve, LLM) reads the layer from the model it serves."""
    from jaxserve.core.config import EngineConfig
    from jaxserve.engine.loading import load_engine_core
    from engine_utils import SMALL_ENGINE

    path, *_, expected = deepseek
    engine = EngineConfig(**{**SMALL_ENGINE, "max_model_len": 64,
                             "speculative_config": {"method": "mtp", "num_speculative_tokens": K}})
    core, _, _ = load_engine_core(path, engine, tokenizer=object())
    assert core.engine_cfg.speculative_config.model == str(path)
    assert run_all(core, _requests("r")) == expected
    assert core.scheduler.spec_stats.num_draft_tokens > 0


def test_a_two_way_model_axis_equals_one_device(deepseek):
    """The head's latent row duplicated to one per device like the target's (its layer's query
    heads and experts split): the same outputs and the same drafts as on one device."""
    path, cfg, weights, *_, expected = deepseek
    one = make_core(cfg, weights, max_model_len=64, speculative_config=_spec(path))
    one_drafts = record_proposals(one)
    run_all(one, _requests("r"))
    mesh = make_mesh(1, 2)
    cfg2, weights2 = load_model(path, mesh)
    core = make_core(cfg2, weights2, mesh=mesh, max_model_len=64, speculative_config=_spec(path))
    assert core.runner.head.cfg.layer.num_kv_heads == 2
    drafts = record_proposals(core)
    assert run_all(core, _requests("r")) == expected
    assert drafts == one_drafts and len(drafts) >= 10


def test_an_fp8_checkpoint_s_mtp_layer_is_widened_and_speculation_stays_lossless(deepseek, tmp_path):
    """DeepSeek-V3 as published, in fp8 blocks with its MTP layer quantized too: the head holds that
    layer widened to the compute dtype (checkpoints/mtp.py), and speculation over the fp8 decoder
    gives the fp8 decoder's own greedy outputs."""
    from quant.formats import write_fp8_block  # tests/quant/

    path = deepseek[0]
    write_fp8_block(path, tmp_path / "fp8", block=8)
    cfg, weights = load_model(tmp_path / "fp8", make_mesh(1, 1))
    assert cfg.quantization.method == "fp8-block"
    expected = run_all(make_core(cfg, weights, max_model_len=64), _requests("q"))
    core = make_core(cfg, weights, max_model_len=64, speculative_config=_spec(tmp_path / "fp8"))
    assert run_all(core, _requests("q")) == expected
    assert core.scheduler.spec_stats.num_draft_tokens > 0
    assert core.runner.compilations_after_warmup == 0
