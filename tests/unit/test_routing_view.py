"""`results --routing` and `results --plot`: the routing checks and the expert-load heatmap, on
results built and encoded with the schemas' own encoder, as a worker writes them."""

from __future__ import annotations

import io
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from schemas import Completed, Completion, RoutedExperts, decode_result, encode
from worker.cli.main import main
from worker.cli.routing_view import (
    PLOT_DPI,
    PLOT_EXTRA_HINT,
    RoutingView,
    draw_expert_load,
    figure_size_in,
)
from worker.core.errors import ConfigError

LAYERS = 4  # as the tiny model: layer 0 dense, three MoE layers
DENSE = 0
TOP_K = 2
EXPERTS = 8


def _routing(rows: int, seed: int) -> np.ndarray:
    """Rows a router could give: `TOP_K` distinct experts per MoE layer, the dense layer zeros."""
    rng = np.random.default_rng(seed)
    routed = np.zeros((rows, LAYERS, TOP_K), dtype=np.uint8)
    for row in range(rows):
        for layer in range(LAYERS):
            if layer != DENSE:
                routed[row, layer] = rng.choice(EXPERTS, TOP_K, replace=False)
    return routed


def _result(
    job_id: str, routings: list[np.ndarray], *, prompt: int = 5, start: int = 0
) -> Completed:
    """A completed result whose completions carry `routings`, token counts matching their rows
    (rows = prompt + tokens - 1 - start), through the wire and back."""
    completions = [
        Completion(
            index=index,
            token_ids=list(range(routed.shape[0] + 1 + start - prompt)),
            text="",
            finish_reason="length",
            routed_experts=RoutedExperts.from_array(routed, start=start, num_experts=EXPERTS),
        )
        for index, routed in enumerate(routings)
    ]
    result = Completed(job_id=job_id, completions=completions, prompt_token_count=prompt)
    decoded = decode_result(encode(result))
    assert isinstance(decoded, Completed)
    return decoded


def _healthy_run() -> list[Completed]:
    return [
        _result("job-a", [_routing(9, 1), _routing(12, 2)]),
        _result("job-b", [_routing(7, 3)], prompt=6, start=2),
    ]


def _with_repeated_ids_in_layer_2() -> Completed:
    routed = _routing(10, 4)
    routed[3, 2] = [5, 5]  # one token of layer 2 routed twice to expert 5
    return _result("job-c", [_routing(8, 5), routed])


def _view(results: list[Completed], plot: Path | None = None) -> RoutingView:
    view = RoutingView(plot)
    for result in results:
        view.add(result)
    return view


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    return width, height


def test_healthy_routing_is_not_flagged_and_the_dense_layer_is_named_dense():
    view = _view(_healthy_run())

    assert view.flags() == []
    assert view.dense_layers() == [DENSE]
    # Every row of every MoE layer counts TOP_K tokens; the dense layer's zeros are no load.
    rows = 9 + 12 + 7
    assert view.load.shape == (LAYERS, EXPERTS)
    assert view.load.sum(axis=1).tolist() == [0] + [rows * TOP_K] * (LAYERS - 1)
    assert "no routing flagged" in view.table()


def test_repeated_ids_flag_exactly_the_planted_layer_and_completion():
    view = _view([*_healthy_run(), _with_repeated_ids_in_layer_2()])

    flags = view.flags()

    assert [(f.job_id, f.index, f.layer, f.problem) for f in flags] == [
        ("job-c", 1, 2, "repeated ids")
    ]
    assert "row 3 (position 3) routes to [5, 5]" in flags[0].detail


def test_an_all_zero_moe_layer_is_flagged_where_other_completions_route_it():
    silent = _routing(10, 6)
    silent[:, 3] = 0
    view = _view([*_healthy_run(), _result("job-d", [silent])])

    assert [(f.job_id, f.index, f.layer, f.problem) for f in view.flags()] == [
        ("job-d", 0, 3, "all zeros")
    ]
    assert view.dense_layers() == [DENSE]


def test_routing_with_no_layer_routing_anywhere_flags_every_completion():
    zeros = [_result("job-e", [np.zeros((6, LAYERS, TOP_K), dtype=np.uint8)] * 2)]

    flags = _view(zeros).flags()

    assert [(f.job_id, f.index, f.layer, f.problem) for f in flags] == [
        ("job-e", 0, None, "all zeros"),
        ("job-e", 1, None, "all zeros"),
    ]


def test_rows_that_do_not_match_the_tokens_less_start_are_flagged():
    short = _result("job-f", [_routing(9, 7)], prompt=5, start=1)
    # One token more than the 9 rows were captured for: 5 + 7 - 1 - 1 = 10 rows expected.
    completion = short.completions[0]
    grown = Completion(
        index=0,
        token_ids=[*completion.token_ids, 99],
        text="",
        finish_reason="length",
        routed_experts=completion.routed_experts,
    )
    bad = decode_result(
        encode(Completed(job_id="job-f", completions=[grown], prompt_token_count=5))
    )
    assert isinstance(bad, Completed)

    flags = _view([*_healthy_run(), bad]).flags()

    assert [(f.job_id, f.index, f.layer, f.problem) for f in flags] == [("job-f", 0, None, "rows")]
    assert flags[0].detail.startswith("9 rows, expected 10")


def test_ids_past_the_models_expert_count_are_flagged():
    routed = _routing(6, 8)
    routed[0, 1] = [2, 9]
    record = RoutedExperts.from_array(routed, num_experts=EXPERTS + 2)
    # The record says 8 experts (as the model's), its ids reach 9.
    wrong = Completed(
        job_id="job-g",
        completions=[
            Completion(
                index=0,
                token_ids=list(range(2)),
                text="",
                finish_reason="length",
                routed_experts=RoutedExperts(
                    data=record.data,
                    shape=record.shape,
                    dtype=record.dtype,
                    num_experts=EXPERTS,
                ),
            )
        ],
        prompt_token_count=5,
    )
    flags = _view([decode_result(encode(wrong))]).flags()  # type: ignore[list-item]

    assert [(f.job_id, f.problem) for f in flags] == [("job-g", "ids out of range")]


def test_a_payload_reference_without_a_store_is_named_unreadable_and_the_rest_is_read():
    routed = RoutedExperts.from_array(_routing(4, 9), num_experts=EXPERTS)
    reference = routed.as_reference("file:///nowhere/p.bin", "0" * 64)
    result = Completed(
        job_id="job-h",
        completions=[
            Completion(
                index=0, token_ids=[1], text="", finish_reason="length", routed_experts=reference
            )
        ],
        prompt_token_count=4,
    )
    view = _view([*_healthy_run(), decode_result(encode(result))])  # type: ignore[list-item]

    assert [(f.job_id, f.problem) for f in view.flags()] == [("job-h", "unreadable")]
    assert "--payload-store" in view.flags()[0].detail
    assert view.load.sum() > 0


def test_plot_renders_the_heatmap_and_marks_the_planted_layer(tmp_path):
    # No skip without matplotlib: `make setup` installs the plot extra with the test tools.
    image = tmp_path / "load.png"
    view = _view([*_healthy_run(), _with_repeated_ids_in_layer_2()], plot=image)
    out, err = io.StringIO(), io.StringIO()

    flagged = view.finish(out, err)

    assert flagged == 1
    width_in, height_in = figure_size_in(LAYERS)
    assert _png_size(image) == (int(width_in * PLOT_DPI), int(height_in * PLOT_DPI)) == (1000, 400)
    assert "job-c/1 layer 2: repeated ids" in out.getvalue()
    assert f"written to {image}" in err.getvalue()

    figure = draw_expert_load(view.load, tmp_path / "again.png", view.flags(), view.dense_layers())
    heatmap, colorbar = figure.axes  # the heatmap and its colour bar, nothing else
    assert colorbar.get_ylabel() == "routed tokens"
    labels = {label.get_text(): label.get_color() for label in heatmap.get_yticklabels()}
    assert labels == {"0d": "black", "1": "black", "2!": "red", "3": "black"}
    assert heatmap.get_images()[0].get_array().shape == (LAYERS, EXPERTS)
    assert "flagged: job-c/1" in heatmap.get_title()


def test_the_checks_print_without_matplotlib(monkeypatch):
    # Absent as an uninstalled package is: every import of it raises ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    view = _view([*_healthy_run(), _with_repeated_ids_in_layer_2()])
    out, err = io.StringIO(), io.StringIO()

    assert view.finish(out, err) == 1

    table = out.getvalue().splitlines()
    assert table[0] == "routing of 5 completions of 3 jobs: 46 rows, 4 layers, 8 experts"
    assert table[2].split()[0] == "0" and table[2].endswith("dense (all zeros in every completion)")
    assert table[4].split()[0] == "2" and table[4].endswith("FLAGGED")
    assert table[-1].startswith("  job-c/1 layer 2: repeated ids: row 3")
    assert err.getvalue() == ""
    with pytest.raises(ConfigError, match=r"vllm-kafka-worker\[plot\]"):
        RoutingView(Path("x.png"))


def test_results_plot_without_matplotlib_says_which_extra_in_one_line_and_exits_2(
    monkeypatch, capsys, tmp_path
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    # Refused before any broker is reached (none runs at this address).
    status = main(
        ["results", "--plot", str(tmp_path / "x.png"), "--bootstrap-servers", "127.0.0.1:1"]
    )

    assert status == 2
    assert capsys.readouterr().err.splitlines() == [f"vllm-kafka-worker: error: {PLOT_EXTRA_HINT}"]
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--routing", "--raw"], "take whole results: leave out --raw"),
        (["--routing", "--follow"], "once all results are read: leave out --follow"),
    ],
)
def test_results_routing_refuses_flags_it_cannot_honour(capsys, flags, message):
    assert main(["results", *flags, "--bootstrap-servers", "127.0.0.1:1"]) == 2
    assert message in capsys.readouterr().err


def _forged(job_id: str, routed: np.ndarray, num_experts: int | None = None) -> Completed:
    """A result whose routing no worker wrote (any producer may write the results topic),
    with as many tokens as its rows need."""
    record = RoutedExperts.from_array(routed)
    if num_experts is not None:
        record = RoutedExperts(
            data=record.data, shape=record.shape, dtype=record.dtype, num_experts=num_experts
        )
    completion = Completion(
        index=0,
        token_ids=list(range(routed.shape[0] + 1 - 5)),
        text="",
        finish_reason="length",
        routed_experts=record,
    )
    decoded = decode_result(
        encode(Completed(job_id=job_id, completions=[completion], prompt_token_count=5))
    )
    assert isinstance(decoded, Completed)
    return decoded


def test_forged_records_claiming_huge_ids_or_layers_are_flagged_not_counted():
    huge_ids = _routing(6, 10).astype(np.int64)
    huge_ids[2, 1] = [1 << 40, 3]  # counting it would allocate 8 TiB
    claims = _routing(6, 11)  # real ids, a claimed expert count no model has
    many_layers = np.ones((6, 5000, 1), dtype=np.uint8)
    forged = [
        _forged("ids", huge_ids),
        _forged("claims", claims, num_experts=10**12),
        _forged("layers", many_layers),
    ]

    view = _view([*_healthy_run(), *forged])

    assert [(f.job_id, f.problem) for f in view.flags()] == [
        ("layers", "implausible shape"),
        ("ids", "ids out of range"),
        ("claims", "implausible shape"),
    ]
    assert view.flags()[1].detail == f"ids up to {1 << 40}, past the 65536 experts this view counts"
    # The claimed count widens nothing: the load is the healthy run's and the real ids'.
    assert view.load.shape == (LAYERS, EXPERTS)
    assert view.load.sum() == (9 + 12 + 7 + 6) * (LAYERS - 1) * TOP_K
