"""The scaling benchmark: size parser, FLOP count, skip logic, records and outputs.

Tiny settings only (C=16, one block, N <= 4096); no timing assertions.
"""

import csv
import json
import platform

import pytest
import torch
from torch import nn

import flarepp
from flarepp.bench.flops import model_flops, sdpa_flops
from flarepp.bench.scaling import (RECORD_KEYS, ScalingConfig, format_table, parse_size,
                                   parse_sizes, ratios, run_scaling, skip_reason, write_outputs)
from flarepp.cli import build_parser

TINY = dict(batch=1, dim=16, heads=2, blocks=1, latents=4, in_dim=2, out_dim=1, repeats=1,
            warmup=0, peak_matmul_size=128, device="cpu")


def test_parse_size():
    """k and M are binary (1k = 1024, 1M = 2^20); a parser bug shifts every point of a sweep."""
    assert parse_size("1k") == 1024 and parse_size("16K") == 16384
    assert parse_size("1M") == 2 ** 20 and parse_size("4096") == 4096
    assert parse_size("1.5k") == 1536
    assert parse_sizes("1k, 4k,64k") == [1024, 4096, 65536]
    for bad in ("abc", "0", "-1k", "1.3", "k"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


def test_flop_count_hand_computed():
    """FLARE, C=16, M=4, one block, io_layers=2, r=2, N=10, B=3, counted by hand:
    input MLP 2*10*2*16 + 2*(2*10*16*16) + 2*10*16*16 = 640 + 10240 + 5120 = 16000;
    output MLP 5120 + 10240 + 2*10*16*1 = 15680; FFN 2 * 2*10*16*32 = 20480;
    mixer [K|V] 10240 + W_O 5120 + encode/decode 2 * 4*4*10*16 = 5120 -> 20480.
    Forward per sample 72640, times B=3 = 217920; step = 3 x forward. A failure means the
    documented counting rule and the code disagree."""
    settings = dict(mixer="flare", in_dim=2, out_dim=1, dim=16, heads=2, blocks=1, latents=4)
    counts = model_flops(settings, n_tokens=10, batch=3)
    assert counts["forward"] == 217920
    assert counts["backward"] == 2 * 217920 and counts["step"] == 3 * 217920


@pytest.mark.parametrize("mixer", ["attention", "flare", "flarepp", "flarepp-simple"])
def test_flop_count_matches_the_models_linear_layers(mixer):
    """The matmul part of the count equals 2 N in out summed over every nn.Linear of the
    built model, plus the SDPA calls of the mixer: a failure means the formula no longer
    describes the model (a projection added, io_layers or the FFN ratio changed)."""
    n, batch, c, m, blocks = 50, 2, 16, 4, 2
    settings = dict(mixer=mixer, in_dim=3, out_dim=2, dim=c, heads=2, blocks=blocks, latents=m)
    model = flarepp.build_model(**settings)
    linear = sum(2 * n * mod.in_features * mod.out_features
                 for mod in model.modules() if isinstance(mod, nn.Linear))
    calls = {"attention": sdpa_flops(n, n, c), "flare": 2 * sdpa_flops(m, n, c)}.get(
        mixer, 3 * sdpa_flops(m, n, c))  # FLARE++ variants: three encode/decode calls
    expected = batch * (linear + blocks * calls)
    assert model_flops(settings, n, batch)["forward"] == pytest.approx(expected, rel=1e-12)


def test_skip_reasons_name_the_limit():
    """A point that would not fit or take too long is skipped with its reason stated."""
    config = ScalingConfig(mixers=["flare"], sizes=[256], time_budget_s=10.0, **TINY)
    memory = skip_reason(config, est_memory=8 * 2 ** 30, est_time=1.0, available=4 * 2 ** 30)
    assert memory.startswith("skipped:") and "GiB" in memory and "available" in memory
    slow = skip_reason(config, est_memory=1.0, est_time=100.0, available=4 * 2 ** 30)
    assert slow.startswith("skipped:") and "time budget" in slow
    assert skip_reason(config, est_memory=1.0, est_time=1.0, available=4 * 2 ** 30) is None


@pytest.mark.slow
def test_sweep_in_process_records_and_skips(tmp_path):
    """One measured point (flare, N=256) and one skipped for time: every record has the
    required keys, the measured one a step time, FLOPs and FLOP/s, the skipped one a reason;
    the JSON, CSV and plot are written."""
    config = ScalingConfig(mixers=["flare", "flarepp"], sizes=[256], isolate=False, rounds=2,
                           **TINY)
    result = run_scaling(config, log=lambda s: None)
    records = result["records"]
    assert [r["mixer"] for r in records] == ["flare", "flarepp"]
    for r in records:
        assert set(RECORD_KEYS) <= set(r), set(RECORD_KEYS) - set(r)
        assert r["status"] == "ok", r["status"]
        assert len(r["times_s"]) == 2 * config.repeats  # both rounds pooled
        assert r["time_s"] > 0 and r["flops"] > 0 and r["achieved_flops_per_s"] > 0
        assert r["fraction_of_peak"] == pytest.approx(
            r["achieved_flops_per_s"] / result["machine"]["peak_flops_per_s"])
    assert ratios(records)[0]["n"] == 256
    flare, plus = ({r["mixer"]: r for r in records}[m] for m in ("flare", "flarepp"))
    each = [p / f for p, f in zip(plus["round_times_s"], flare["round_times_s"])]
    assert len(each) == 2 and ratios(records)[0]["round_ratios"] == pytest.approx(each)
    assert ratios(records)[0]["time_ratio_rounds"] == pytest.approx(sum(each) / 2)

    tight = ScalingConfig(mixers=["flare"], sizes=[4096], isolate=False, time_budget_s=1e-9,
                          **TINY)
    skipped = run_scaling(tight, log=lambda s: None)["records"][0]
    assert skipped["status"].startswith("skipped:") and "time budget" in skipped["status"]
    assert skipped["time_s"] is None and skipped["estimated_time_s"] > 0

    paths = write_outputs({**result, "records": records + [skipped]}, tmp_path / "s.json")
    saved = json.loads(paths["json"].read_text())
    assert len(saved["records"]) == 3 and saved["flarepp_over_flare"][0]["n"] == 256
    with open(paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [r["status"][:7] for r in rows] == ["ok", "ok", "skipped"]
    assert paths["png"].stat().st_size > 0


STAND_IN_FLARE_STUDY = """
import torch
from torch import nn


class FLAREModel(nn.Module):  # a stand-in with the study's constructor keywords
    def __init__(self, in_dim, out_dim, channel_dim, num_blocks, num_heads, num_latents,
                 attn_scale, num_layers_in_out_proj, num_layers_k_proj, num_layers_v_proj,
                 num_layers_ffn, ffn_mlp_ratio, rmsnorm):
        super().__init__()
        assert num_layers_k_proj == num_layers_v_proj == -1 and ffn_mlp_ratio == 2.0
        self.lin = nn.Linear(in_dim, out_dim)

    def forward(self, x):
        return self.lin(x)
"""


def test_flare_study_model_is_timed_from_a_named_clone_only(tmp_path):
    """``flare-study`` is the FLARE study's own FLAREModel, imported from the clone the user
    names (here a stand-in file at the study's path), timed beside flarepp's mixers and
    counted with FLARE's FLOPs; without a clone, or with a path that is not one, the error
    says what is missing. A failure points at the optional comparison becoming a hard
    dependency, or at a reference point silently measuring flarepp's own model."""
    from flarepp.bench.reference import REFERENCE_MIXER
    (tmp_path / "pdebench" / "models").mkdir(parents=True)
    (tmp_path / "pdebench" / "models" / "flare.py").write_text(STAND_IN_FLARE_STUDY)
    config = ScalingConfig(mixers=["flare", REFERENCE_MIXER], sizes=[256], isolate=False,
                           reference_repo=str(tmp_path), **TINY)
    records = run_scaling(config, log=lambda s: None)["records"]
    assert [r["status"] for r in records] == ["ok", "ok"]
    assert records[1]["flops"] == records[0]["flops"]
    assert records[1]["params"] == 2 * 1 + 1  # the stand-in's one linear, not flarepp's
    assert ratios(records, REFERENCE_MIXER, "flare")[0]["n"] == 256
    with pytest.raises(ValueError, match="reference_repo"):
        ScalingConfig(mixers=[REFERENCE_MIXER], sizes=[256], **TINY)
    bad = ScalingConfig(mixers=[REFERENCE_MIXER], sizes=[256], isolate=False,
                        reference_repo=str(tmp_path / "nowhere"), **TINY)
    with pytest.raises(FileNotFoundError, match="clone of the FLARE study"):
        run_scaling(bad, log=lambda s: None)


@pytest.mark.slow
@pytest.mark.parametrize("retain", [True, False])
def test_cpu_point_in_fresh_interpreter(retain):
    """The default CPU path: the point runs in its own interpreter, whose allocator keeps
    freed memory unless switched off (the record says which, as the worker applied it), and
    reports the growth of its resident set during the step (0: the probe measured nothing)."""
    config = ScalingConfig(mixers=["flare"], sizes=[4096], threads=1, retain_memory=retain,
                           **TINY)
    assert config.isolate  # the CPU default
    (record,) = run_scaling(config, log=lambda s: None)["records"]
    assert record["status"] == "ok", record["status"]
    if not retain:
        assert record["malloc"] == "system (switched off by FLAREPP_RETAIN_MEMORY=0)"
    elif platform.libc_ver()[0] == "glibc":
        assert record["malloc"].startswith("retain (glibc"), record["malloc"]
    assert record["peak_mem_bytes"] > 0 and "VmHWM" in record["mem_method"]
    assert record["threads"] == 1 and record["params"] > 0


def test_retain_memory_follows_the_switch(monkeypatch):
    """The sweep's default follows FLAREPP_RETAIN_MEMORY, as every compute command does."""
    monkeypatch.delenv("FLAREPP_RETAIN_MEMORY", raising=False)
    assert ScalingConfig(**TINY).retain_memory is True
    monkeypatch.setenv("FLAREPP_RETAIN_MEMORY", "0")
    assert ScalingConfig(**TINY).retain_memory is False


def test_cli_parses_bench_scaling():
    """`flarepp bench scaling` parses the issue's command line, sizes with k/M suffixes."""
    args = build_parser().parse_args(
        ["bench", "scaling", "--mixers", "attention,flare,flarepp", "--n", "1k,4k,1M",
         "--dtype", "bf16", "--device", "cuda:1", "--json", "out.json", "--batch", "2",
         "--repeats", "3", "--time-budget", "60", "--total-budget", "300"])
    assert args.n == [1024, 4096, 2 ** 20] and args.dtype == "bf16" and args.batch == 2
    assert args.time_budget == 60.0 and args.json == "out.json" and args.device == "cuda:1"
    assert args.total_budget == 300.0
    assert build_parser().parse_args(["bench", "scaling"]).device == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "scaling", "--n", "4q"])


def test_config_errors_are_named():
    """A typo in --mixers fails before any measurement, listing the known mixers; so do
    settings that cannot work together."""
    with pytest.raises(ValueError, match="known mixers"):
        ScalingConfig(mixers=["flare", "flarepp++"], **TINY)
    with pytest.raises(ValueError, match="warmup"):
        ScalingConfig(compile=True, **{**TINY, "warmup": 0})
    with pytest.raises(ValueError, match="total_budget_s"):
        ScalingConfig(total_budget_s=0.0, **TINY)
    with pytest.raises(ValueError, match="unknown device"):
        ScalingConfig(**{**TINY, "device": "gpu0"})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            ScalingConfig(**{**TINY, "device": "cuda"})
    assert ScalingConfig(**{**TINY, "device": "auto"}).device == (
        "cuda:0" if torch.cuda.is_available() else "cpu")


def test_total_budget_skips_the_rest_and_the_table_shows_it():
    """Once the sweep's total budget is spent, the remaining points are skipped with the
    reason (gpu-check relies on this to fit its slot), and the printed table says so."""
    config = ScalingConfig(mixers=["flare", "flarepp"], sizes=[64, 128], isolate=False,
                           total_budget_s=1e-6, **TINY)
    records = run_scaling(config, log=lambda s: None)["records"]
    assert all(r["status"].startswith("skipped: the sweep's total time budget")
               for r in records), [r["status"] for r in records]
    config = ScalingConfig(mixers=["flare"], sizes=[64], isolate=False, **TINY)
    records += run_scaling(config, log=lambda s: None)["records"]
    table = format_table(records).splitlines()
    assert table[0].split() == ["N", "flare", "flarepp"] and "skipped" in table[-1]
    assert "/" in table[2]  # N=64: flare's measured step time / peak memory


def test_bf16_autocast_point_runs():
    """Mixed precision runs the model under autocast with RMSNorm (C.2) and measures it."""
    config = ScalingConfig(mixers=["flarepp"], sizes=[128], dtype="bf16", isolate=False,
                           **TINY)
    assert config.model_settings("flarepp")["norm"] == "rmsnorm"
    (record,) = run_scaling(config, log=lambda s: None)["records"]
    assert record["status"] == "ok" and record["dtype"] == "bf16"


def test_bench_scaling_exits_non_zero_when_a_point_fails(monkeypatch, capsys):
    """`flarepp bench scaling` (the Figure 6 sweep of `make gpu-check`) returns 1 when a
    point fails (here flare raises a kernel-input RuntimeError) and names it; a point that
    runs out of memory (flarepp) is reported as skipped and alone would exit 0. Exit 0 with
    a failed point means gpu-check's sweep can never fail."""
    from flarepp.bench import scaling
    from flarepp.cli import main

    def fake_measure(config, mixer, n, record, dev):
        if mixer == "flare":
            raise RuntimeError("Query is not correctly aligned")
        raise scaling.PointOutOfMemory("out of memory: tried to allocate 80 GiB")

    monkeypatch.setattr(scaling, "_measure", fake_measure)
    monkeypatch.setattr(scaling, "_machine", lambda config: {
        "device_name": "test", "threads": 1, "torch": torch.__version__,
        "peak_flops_per_s": 1e9, "peak_dtype": config.dtype})
    argv = ["bench", "scaling", "--device", "cpu", "--n", "256", "--batch", "1", "--dim", "16",
            "--heads", "2", "--blocks", "1", "--latents", "4"]
    assert main(argv + ["--mixers", "flare,flarepp"]) == 1
    err = capsys.readouterr().err
    assert "FAILED flare N=256" in err and "flarepp" not in err
    assert main(argv + ["--mixers", "flarepp"]) == 0
    assert "skipped: out of memory" in capsys.readouterr().out


def test_scaling_cli_prints_the_per_round_ratios(monkeypatch, capsys):
    """`flarepp bench scaling --rounds 2` prints, beside the ratio of pooled medians, each
    round's FLARE++ / FLARE ratio and their median (fake timings: FLARE++ 1.5x, then 1.1x
    FLARE in a slower round)."""
    from flarepp.bench import scaling
    from flarepp.cli import main
    calls = []

    def fake_measure(config, mixer, n, record, dev):
        calls.append(mixer)
        slow = 2.0 if len(calls) > 2 else 1.0
        t = slow * (1.0 if mixer == "flare" else (1.5 if slow == 1.0 else 1.1))
        return {"times_s": [t], "cpu_times_s": [t], "peak_mem_bytes": 1, "threads": 1,
                "baseline_mem_bytes": 0, "mem_method": "fake", "params": 1, "malloc": "fake"}

    monkeypatch.setattr(scaling, "_measure", fake_measure)
    monkeypatch.setattr(scaling, "_machine", lambda config: {
        "device_name": "test", "threads": 1, "torch": torch.__version__,
        "peak_flops_per_s": 1e9, "peak_dtype": config.dtype})
    assert main(["bench", "scaling", "--device", "cpu", "--n", "256", "--batch", "1",
                 "--dim", "16", "--heads", "2", "--blocks", "1", "--latents", "4",
                 "--mixers", "flare,flarepp", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert calls == ["flare", "flarepp", "flare", "flarepp"]
    assert "per round: median 1.300 (1.500, 1.100)" in out
