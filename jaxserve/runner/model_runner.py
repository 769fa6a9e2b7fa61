"""Owns the weights, the KV pages and the mesh; compiles every declared bucket; runs steps.

A step is two jitted programs (programs.py) dispatched back to back without a host sync:
  forward (bucket T x S): embed -> layers over the donated KV pages -> logits for the S sample rows
  sample  (bucket S x H): penalties/temperature/top-k/top-p/min-p -> token ids, logprobs
Splitting them keeps the compiled-program count additive (|T x S| + |S x H|) instead of
multiplicative, while the KV pool still never leaves the device and is never copied.

The sample program also pads the sampled ids into a fixed `[max rows]` device buffer that the next
step's forward reads for its in-flight decodes (async scheduling: `StepArrays.prev_sample_row`), so
the next step can be dispatched before this one's ids reach the host.

Compilation is counted through jax.monitoring: after `warmup()` every new compilation is logged
as an error and counted in `compilations_after_warmup` (a metric and a test assertion).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.core.buckets import Program
from jaxserve.core.capacity import plan_capacity, swap_costs
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.core.linear_limits import check_linear
from jaxserve.core.step_plan import StepPlan, SwapCosts
from jaxserve.model import kv_cache
from jaxserve.model.attention import make_attention
from jaxserve.model.eagle3 import Eagle3Config
from jaxserve.model.expert_parallel import make_moe
from jaxserve.model.kv_heads import duplicate_kv_heads
from jaxserve.model.mtp import MtpConfig
from jaxserve.model.weights import Weights
from jaxserve.parallel import sharding
from jaxserve.parallel.layouts import layout_rules
from jaxserve.quant import kv as kv_quant
from jaxserve.runner.background_compile import BucketCompiler, largest
from jaxserve.runner.compile_counter import CompileCounter
from jaxserve.runner.host_tier import HostTier, read_pages, scatter_runs, write_pages
from jaxserve.runner.kv_pull import TransferEndpoint
from jaxserve.runner.machine import machine_info
from jaxserve.runner.packing import pack
from jaxserve.runner.program_store import ProgramTable, cache_directory, fingerprint
from jaxserve.runner.programs import (DONATED, FORWARD_STATICS, abstract_lora, copy_step, copy_width, forward_step,
    kv_dtype, lower_program, num_state_slots, pad_state_copies, rows_width, sample_step)
from jaxserve.runner.proposers.draft_model import DraftRunner, check_compatible
from jaxserve.runner.proposers.hidden_heads import HeadRunner
from jaxserve.runner.sampler import SamplerOutput, bitmask_words
from jaxserve.runner.sampling_tensors import SamplingTensors
from jaxserve.runner.step_inputs import StepArrays, StepInputBuilder, StepInputs, row_that_sampled, sampler_spans
from jaxserve.runner.warmup import warm_up

logger = logging.getLogger("jaxserve.runner.model_runner")


def _local_replica(x: jax.Array) -> np.ndarray:
    if not x.sharding.is_fully_replicated:
        raise RuntimeError(f"a sampler output spans processes without a replica here: {x.sharding}")
    return np.asarray(x.addressable_data(0))


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, weights: Weights, engine_cfg: EngineConfig, mesh: Mesh,
                 dtype: Any = jnp.float32, draft: tuple[Any, Any] | None = None) -> None:
        """draft: the speculative proposer's (config, weights): a draft model's (ModelConfig,
        Weights) for method draft_model, an EAGLE-3 head's (Eagle3Config, Eagle3Weights) for eagle3, the
        checkpoint's MTP layer (MtpConfig, MtpWeights) for mtp."""
        CompileCounter.install()
        self.rules = rules = layout_rules(engine_cfg.layout, model_cfg)
        # A model axis wider than the KV head count holds one duplicated KV head per device.
        kv_heads = model_cfg.num_kv_heads
        checkpoint_cfg = model_cfg  # what adapters are checked against (KV heads as stored)
        model_cfg, weights = duplicate_kv_heads(model_cfg, weights, mesh, rules)
        if model_cfg.num_kv_heads != kv_heads:
            logger.info("KV heads duplicated %d -> %d: one per device of the %d-way model axis", kv_heads,
                        model_cfg.num_kv_heads, mesh.shape[sharding.MODEL_AXIS])
        self.model_cfg = model_cfg
        self._checkpoint_cfg = checkpoint_cfg
        self.mesh = mesh
        self.placement = placement = sharding.Placement(mesh, rules)
        self.weights = weights
        self.dtype = jnp.dtype(dtype)
        # Unset sizes (pool, batch limits, context, buckets) come from the machine and the model.
        machine = machine_info(mesh)
        # a head reading the target's hidden states (EAGLE-3, MTP), else a draft model
        head = draft if draft is not None and isinstance(draft[0], (Eagle3Config, MtpConfig)) else None
        if draft is not None and head is None:
            check_compatible(model_cfg, draft[0])
            draft = duplicate_kv_heads(*draft, mesh)
        check_linear(engine_cfg, model_cfg)
        if engine_cfg.enable_lora and (model_cfg.moe is not None or model_cfg.mla is not None):
            kind = "latent-attention" if model_cfg.mla is not None else "mixture-of-experts"
            raise ValueError(f"--enable-lora: LoRA adapters on a {kind} model are not supported yet")
        lora_bytes = sharding.bytes_per_device(abstract_lora(model_cfg, engine_cfg, self.dtype, placement))
        self.capacity = plan_capacity(engine_cfg, model_cfg, machine, self.dtype.itemsize,
                                      mesh.shape[sharding.MODEL_AXIS],
                                      draft=None if draft is None else head[0].layer if head else draft[0],
                                      lora_bytes=lora_bytes)
        for line in self.capacity.lines:
            logger.info("%s", line)
        self.engine_cfg = engine_cfg = self.capacity.engine
        num_pages = engine_cfg.num_kv_pages
        kv_quant.check_platform(engine_cfg.kv_cache_dtype, machine.platform, machine.device_kind,
                                getattr(mesh.devices.flat[0], "compute_capability", None))
        if note := kv_quant.platform_note(engine_cfg.kv_cache_dtype, machine.platform):
            logger.warning("%s", note)
        self.num_state_slots = num_state_slots(engine_cfg, model_cfg)  # a hybrid stack's (0: none)
        self.kv = kv_cache.allocate(model_cfg, num_pages, engine_cfg.page_size, kv_dtype(engine_cfg, self.dtype),
                                   placement, self.num_state_slots, self.dtype)
        self.num_pages = num_pages
        self._transfer: TransferEndpoint | None = None  # PD over jax.experimental.transfer, on first use
        self._transfer_lock = threading.Lock()
        self._replicated = sharding.replicated(mesh)
        page_bytes = sum(leaf.nbytes for leaf in kv_cache.page_leaves(self.kv)) // num_pages  # all devices' shards
        self.num_host_pages = int(engine_cfg.kv_offload_gib * 2**30 // page_bytes) if engine_cfg.kv_offload_gib else 0
        self.host_tier = HostTier(self.kv, self._put, self.num_host_pages) if engine_cfg.kv_offload_gib else None
        self.swap_costs = None
        if self.host_tier is not None:
            self.swap_costs = SwapCosts(*swap_costs(machine, sum(l.nbytes for l in jax.tree.leaves(weights)),
                                                    self.dtype.itemsize, page_bytes))
            logger.info("KV host tier: %d pages x %d tokens = %d tokens in %.2f GiB of host memory (%s)",
                        self.num_host_pages, engine_cfg.page_size, self.num_host_pages * engine_cfg.page_size,
                        engine_cfg.kv_offload_gib, self.host_tier.memory)
        self.builder = StepInputBuilder(engine_cfg, num_pages, model_cfg.vocab_size, eagle=head is not None,
                                        num_groups=model_cfg.kv_groups.num_groups, num_state_slots=self.num_state_slots)
        self._attention = make_attention(engine_cfg.attention_backend, model_cfg, placement)
        self._moe = make_moe(model_cfg, placement)  # None unless the layout splits whole experts
        self._rows_width = rows_width(engine_cfg)
        # [rows_width] int32: the last dispatched step's sampled ids, on the device
        self._prev_ids = self._put(np.zeros(self._rows_width, np.int32))
        self._all_allowed: dict[int, jax.Array] = {}  # rows -> [rows, W] int32 all-ones bitmask
        # every program by bucket (the target's, and a draft's or EAGLE head's), loaded from the
        # compilation cache dir without tracing; keyed on what shapes programs only, so every entry
        # point with the same sizes shares them. The attention's name: "auto" resolves per machine
        # (a native CPU kernel that built, or not)
        shaping = {**engine_cfg.program_fields(), **({"state_slots": self.num_state_slots} if self.num_state_slots else {})}
        self.programs = ProgramTable(cache_directory(), fingerprint(model_cfg, shaping, self.dtype,
                                                                    rules,
                                                                    mesh.shape, mesh.devices.tolist(),
                                                                    getattr(self._attention, "__name__", "")),
                                     list(mesh.devices.flat),
                                     preload=engine_cfg.warmup == "full" or draft is not None)  # see warmup.py
        self.draft = (DraftRunner(*draft, engine_cfg, placement, self.dtype, self._put, self.programs)
                      if draft is not None and head is None else None)
        self.head = (HeadRunner(*head, weights, engine_cfg, placement, self.dtype, self._put, self.programs)
                     if head is not None else None)
        self._aux: jax.Array | None = None  # with a head: the last forward's states it reads ([T, 3 D] for
        # EAGLE-3, [T, D] for MTP)
        # the proposer's pool mirrors the target's pages: its pages move between the tiers too
        self._proposer_tier = (HostTier(self.proposer.kv, self._put, self.num_host_pages)
                               if self.host_tier is not None and self.proposer is not None else None)
        self.lora = self._lora_slots() if engine_cfg.enable_lora else None
        self.warmed_up = False
        self.compilations_after_warmup = 0
        self.background: BucketCompiler | None = None  # compiling the buckets a background warm-up left out
        self.step_limit: tuple[int, int] | None = None  # the largest bucket a step may take (None: any declared)
        self.programs_declared = 0  # serving programs (set by warm-up)
        # Multi-host leader: every step's device calls are sent to the other processes first
        # (multihost.Followers), which dispatch the same programs over their own shards.
        self.followers: Any = None

    # -- steps ---------------------------------------------------------------------------------

    def _put(self, tree: Any) -> Any:
        return sharding.put(tree, self._replicated)

    def forward(self, inputs: StepInputs) -> jax.Array:
        """Dispatches the step's page copies and forward; returns the [S, V] logits (on the device,
        no host sync). A step is `forward` then `sample`, then `fetch` for numpy: split so that a
        step with grammar-constrained rows can run its forward while the host computes their masks."""
        if self.followers is not None:
            self.followers.send(("forward", inputs))
        before = CompileCounter.count()
        self._copy_pages(inputs.copies, inputs.state_copies)
        logits, self.kv = self._forward(inputs.arrays)
        if self.draft is not None:
            self.draft.fill(inputs.arrays, self._prev_ids)
        self._count_compilations(before, inputs)
        return logits

    def move_pages(self, demotions: list[tuple[int, int]], promotions: list[tuple[int, int]]) -> None:
        """The host KV tier's moves for the step planned next (demotions first: page_allocator.py)."""
        if self.followers is not None:
            self.followers.send(("move", demotions, promotions))
        before = CompileCounter.count()
        out, back = (np.asarray(m, np.int32).reshape(-1, 2) for m in (demotions, promotions))
        if len(out):
            self.host_tier.demote(self.kv, out)
            if self._proposer_tier is not None:
                self._proposer_tier.demote(self.proposer.kv, out)
        if len(back):
            self.kv = self.host_tier.promote(self.kv, back)
            if self._proposer_tier is not None:
                self.proposer.kv = self._proposer_tier.promote(self.proposer.kv, back)
        self._count_compilations(before, what=f"{len(demotions)} demotions, {len(promotions)} promotions")

    def export_pages(self, pages: list[int]) -> list[np.ndarray]:
        """The K/V of `pages`, on the host (waits for the device): a prefill instance's export."""
        return read_pages(self.kv, pages, self._put)

    def check_pages(self, theirs: list[tuple[tuple[int, ...], str]]) -> None:
        """ValueError when K/V exported by another instance (per leaf: one page's shape, dtype
        name) is shaped differently from this pool's."""
        mine = [(a.shape[1:], a.dtype.name) for a in jax.tree.leaves(self.kv)]
        if [s for s, _ in mine] != [s for s, _ in theirs]:
            raise ValueError(f"the remote instance's KV pages do not fit this pool: {len(theirs)} arrays of "
                             f"{theirs[0] if theirs else None}, this pool {len(mine)} of {mine[0]} (same model, "
                             f"page size, KV dtype and KV heads per device needed)")

    def import_pages(self, pages: list[int], leaves: list[np.ndarray]) -> None:
        """Fills `pages` with K/V exported by another instance (read_pages' layout; check_pages first)."""
        before = CompileCounter.count()
        self.kv = write_pages(self.kv, pages, leaves, self._put)
        self._count_compilations(before, what=f"importing {len(pages)} KV pages")

    def offer_pages(self, pages: list[int], bind_host: str) -> dict:
        """A prefill instance's export over jax.experimental.transfer (kv_pull.py): `pages` offered
        for one pull; returns the offer (JSON-able)."""
        return self._transfer_endpoint(bind_host).offer(self.kv, pages, self._put)

    def pull_pages(self, host: str, offer: dict, bind_host: str) -> list[Any]:
        """Pulls the pages another instance offered onto this pool's devices (not into the pool:
        write_pulled does that once they are keyed). ValueError when they do not fit or fail.
        Any thread, while steps run: it reads only the pool's shapes and shardings."""
        self.check_pages([(tuple(shape), dtype) for dtype, shape in offer["leaves"]])
        return self._transfer_endpoint(bind_host).pull(self.kv, host, offer)

    def write_pulled(self, runs: list[Any], dst: list[int]) -> None:
        """Writes pulled rows into pages `dst` (one per row; self.num_pages drops a row)."""
        before = CompileCounter.count()
        self.kv = scatter_runs(self.kv, runs, dst, self._put)
        self._count_compilations(before, what=f"writing {len(dst)} pulled KV pages")

    def _transfer_endpoint(self, bind_host: str) -> TransferEndpoint:
        with self._transfer_lock:
            if self._transfer is None:
                self._transfer = TransferEndpoint(bind_host)
            return self._transfer

    def _copy_pages(self, copies: np.ndarray, state_copies: np.ndarray | None = None) -> None:
        """Page copies (and a hybrid stack's state-slot copies) before a step, in one program."""
        if len(copies) or (state_copies is not None and len(state_copies)):
            src, dst = self._put(self._pad_copies(copies))
            states = self._put(pad_state_copies(state_copies, self.num_state_slots))
            self.kv = self.programs.call(("copy",), copy_step, {}, DONATED, self.kv, src, dst, *states)
            if self.proposer is not None:  # its pool mirrors the target's pages
                self.proposer.copy_pages(copy_step, src, dst)

    @property
    def proposer(self) -> DraftRunner | HeadRunner | None:
        """The draft model or EAGLE-3 head that fills the plans' draft slots (propose), if any."""
        return self.draft if self.draft is not None else self.head

    def propose(self, plan: StepPlan, prev_plan: StepPlan | None) -> list[list[int]]:
        """Proposals for the plan's chunks with draft slots (in plan order; possibly fewer ids than
        slots). Applies the plan's page copies first (a draft writes into the copied pages) and
        clears them. prev_plan: the last step dispatched (an EAGLE-3 head continues from the row
        of it that sampled each sequence's last token; a sequence it did not sample gets none)."""
        before = CompileCounter.count()
        self._copy_pages(np.asarray(plan.copies, np.int32).reshape(-1, 2))
        plan.copies = []
        chunks = [c for c in plan.listed if c.draft_token_ids]  # steady decodes have none
        if self.draft is not None:
            out = self.draft.propose(chunks, [len(c.draft_token_ids) for c in chunks])
        else:
            spans = sampler_spans(prev_plan)
            rows = [row_that_sampled(spans, c) for c in chunks]
            found = [i for i, r in enumerate(rows) if r is not None]
            out = [[] for _ in chunks]
            if found:
                got = self.head.propose([chunks[i] for i in found], [rows[i] for i in found],
                                         [len(chunks[i].draft_token_ids) for i in found])
                for i, ids in zip(found, got):
                    out[i] = ids
        self._count_compilations(before, what=f"a draft proposal of {len(chunks)} sequences")
        return out

    def sample(self, logits: jax.Array, inputs: StepInputs, bitmask: np.ndarray | None = None) -> SamplerOutput:
        """Dispatches the sampler over `forward`'s logits. bitmask: [S, W] int32 allowed-token bits
        (structured output), or None when no row is constrained: a resident all-ones mask is
        passed then, so such steps transfer nothing for it."""
        if self.followers is not None:
            self.followers.send(("sample", bitmask))
        before = CompileCounter.count()
        out, self._prev_ids = self._sample(logits, inputs.sampling, bitmask)
        for leaf in out:
            if leaf.is_fully_addressable:
                leaf.copy_to_host_async()
        if self.head is not None:
            self.head.fill(inputs.arrays, inputs.eagle_shift, self._aux, self._prev_ids)
        self._count_compilations(before, inputs)
        return out

    def _count_compilations(self, before: int, inputs: StepInputs | None = None, what: str = "") -> None:
        if self.warmed_up and CompileCounter.count() != before:
            new = CompileCounter.count() - before
            self.compilations_after_warmup += new
            if inputs is not None:
                what = (f"step shape T={inputs.arrays.token_ids.shape[0]} S={inputs.arrays.seq_lens.shape[0]} "
                        f"L={inputs.sampling.num_rows} H={inputs.sampling.table_ids.shape[1]}")
            logger.error("%d compilation(s) after warm-up for %s: a bucket is missing from warm-up", new, what)

    def _forward_args(self, arrays: StepArrays) -> dict[str, Any]:
        packed, spec = pack(arrays)
        return dict(kv=self.kv, packed=self._put(packed), spec=spec, cfg=self.model_cfg,
                    attention_fn=self._attention, prev_ids=self._prev_ids,
                    lora=self.lora.arrays if self.lora is not None else None,
                    aux_layers=self.head.aux_layers if self.head is not None else (), moe_fn=self._moe)

    def _lora_slots(self) -> "DeviceSlots":
        """Every --lora-modules adapter read and checked now; slots filled as requests need them."""
        from jaxserve.runner.lora_slots import DeviceSlots

        cfg = self.engine_cfg
        slots = DeviceSlots(self.model_cfg, cfg, self.dtype, self.placement, self._put, self._checkpoint_cfg)
        logger.info("LoRA: %d adapter(s), %d device slots of rank %d: %s", len(slots.adapters), cfg.max_loras,
                    cfg.max_lora_rank, ", ".join(f"{n} (rank {r}, {'/'.join(m)})" for n, (r, m) in slots.adapters.items()))
        return slots

    def load_lora(self, slot: int, name: str) -> None:
        before = CompileCounter.count()
        self.lora.load(slot, name)
        self._count_compilations(before, what=f"loading LoRA adapter {name!r} into slot {slot}")

    def _forward(self, arrays: StepArrays) -> tuple[jax.Array, kv_cache.KVPages]:
        """(logits, pages); with an EAGLE-3 head its input states are kept for the fill (sample)."""
        args = self._forward_args(arrays)
        statics = {k: args.pop(k) for k in FORWARD_STATICS}
        logits, kv, *aux = self.programs.call(("forward", statics["spec"]), forward_step, statics, DONATED,
                                              self.weights, **args)
        if aux:
            self._aux = aux[0]
        return logits, kv

    def _sample(self, logits: jax.Array, tensors: SamplingTensors,
                bitmask: np.ndarray | None = None) -> tuple[SamplerOutput, jax.Array]:
        packed, spec = pack(tensors)
        rows = tensors.num_rows
        if bitmask is None:
            mask = self._all_allowed.get(rows)
            if mask is None:
                mask = self._all_allowed[rows] = self._put(
                    np.full((rows, bitmask_words(self.model_cfg.vocab_size)), -1, np.int32))
        else:
            mask = self._put(bitmask)
        statics = dict(spec=spec, vocab_size=self.model_cfg.vocab_size, width=self._rows_width)
        return self.programs.call(("sample", spec), sample_step, statics, (), logits, self._put(packed), mask,
                                  self._prev_ids)

    def compile(self, program: Program) -> jax.stages.Compiled:
        """One serving program compiled from shapes alone (for memory and HLO inspection)."""
        return lower_program(program, self.model_cfg, self.engine_cfg, self.placement, self.dtype,
                             self._attention).compile()

    @staticmethod
    def fetch(out: SamplerOutput) -> SamplerOutput:
        """The sampled ids etc. as numpy (across processes, multi-host, from this process's replica)."""
        return SamplerOutput(*(jax.device_get(x) if x.is_fully_addressable else _local_replica(x) for x in out))

    def _pad_copies(self, copies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) padded to max_num_seqs entries; padding targets an out-of-bounds page."""
        width = copy_width(self.engine_cfg, self.model_cfg)
        if len(copies) > width:
            raise ValueError(f"{len(copies)} page copies in one step exceed {width} (one per sequence and layer group)")
        src = np.zeros(width, np.int32)
        dst = np.full(width, self.num_pages, np.int32)
        src[: len(copies)], dst[: len(copies)] = copies[:, 0], copies[:, 1]
        return src, dst

    # -- warm-up -------------------------------------------------------------------------------

    def warmup(self, progress: Callable[[int, int, str], None] | None = None, background: bool = False) -> float:
        """Compiles and runs the declared programs; returns seconds (runner/warmup.py). background:
        the smallest bucket now, the others on a thread while steps run on the ready ones."""
        return warm_up(self, progress, background)

    @property
    def programs_compiled(self) -> int:
        """Serving programs compiled so far (all of programs_declared once warm-up and any
        background compilation are done)."""
        if self.background is not None:
            return self.background.num_compiled
        return self.programs_declared if self.warmed_up else 0

    def set_ready_buckets(self, buckets: list[tuple[int, int]]) -> None:
        """Steps may take these buckets (called by the background compiler's thread: one assignment
        each, read by the serving thread at its next step)."""
        self.builder.buckets = buckets
        self.step_limit = largest(buckets)

