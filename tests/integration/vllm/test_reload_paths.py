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
