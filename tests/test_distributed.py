"""Token-sharded context parallelism (paper App. B) against the single-process model.

Every sharded run happens in R fresh processes joined by gloo (``run_on_ranks``); the
single-process reference runs here. Shape letters: B batch, N tokens, H heads, M latents,
D head width. Tolerances: 1e-10 (float64) and 1e-5 (float32), relative to max(1, |ref|).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from flarepp.distributed import (SHARDABLE_MIXERS, SHARDABLE_MODELS, RankFailure, context_parallel,
                                 distributed_encode_with_lse, gather_tokens, global_sum,
                                 run_on_ranks, shard_slice)
from flarepp.mixers import list_mixers
from flarepp.models import MODELS, build_model, list_models
from flarepp.ops import encode_with_lse
from reference import explicit_encode_lse

DIM, HEADS, LATENTS, BLOCKS, IN_DIM, OUT_DIM, BATCH = 16, 2, 4, 2, 3, 2, 2
SHARDABLE = [name for name in list_mixers() if name in SHARDABLE_MIXERS]
NOT_SHARDABLE = [name for name in list_mixers() if name not in SHARDABLE_MIXERS]
NOT_SHARDABLE_MODELS = [name for name in list_models() if name not in SHARDABLE_MODELS
                        and getattr(MODELS.get(name), "input_kind", "points") == "points"]
DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOL = {"float64": 1e-10, "float32": 1e-5}


# ---------------------------------------------------------------- shared case builders

def make_model(mixer: str, dtype: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny model whose every parameter is perturbed away from its (structured) init."""
    torch.manual_seed(seed)
    settings = dict(mixer=mixer, in_dim=IN_DIM, out_dim=OUT_DIM, dim=DIM, heads=HEADS,
                    latents=LATENTS, blocks=BLOCKS)
    model = build_model(**{**settings, **overrides}).to(DTYPES[dtype])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def make_batch(n: int, dtype: str, masked: bool, seed: int = 1):
    """Inputs ``[B, N, in]``, loss weights ``[B, N, out]`` and a mask (or None); sample 1's
    last half is padding, so some shards hold no real token of that sample."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, n, IN_DIM, generator=g, dtype=torch.float64).to(DTYPES[dtype])
    w = torch.randn(BATCH, n, OUT_DIM, generator=g, dtype=torch.float64).to(DTYPES[dtype])
    if not masked:
        return x, w, None
    mask = torch.rand(BATCH, n, generator=g) > 0.3
    mask[1, n // 2:] = False
    mask[:, 0] = True
    return x, w, mask


def run_reference(case: dict) -> dict:
    model = make_model(case["mixer"], case["dtype"], **case.get("model", {}))
    x, w, mask = make_batch(case["n"], case["dtype"], case["masked"])
    x.requires_grad_(True)
    y = model(x, mask)
    (y * w).sum().backward()
    return {"y": y.detach().numpy(), "x_grad": x.grad.numpy(),
            "grads": {k: p.grad.numpy() for k, p in model.named_parameters()}}


def run_sharded(group, case: dict) -> dict:
    """This rank's shard of the outputs and input gradient, and its reduced parameter
    gradients. Ranks other than 0 start from different weights: ``context_parallel`` must
    copy rank 0's."""
    rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    model = make_model(case["mixer"], case["dtype"], seed=rank, **case.get("model", {}))
    x, w, mask = make_batch(case["n"], case["dtype"], case["masked"])
    with context_parallel(model, group) as cp:
        sizes = case.get("sizes", {}).get(world)
        x_r = cp.shard(x, sizes=sizes).detach().requires_grad_(True)
        y_r = model(x_r, cp.shard(mask, sizes=sizes))
        (y_r * cp.shard(w, sizes=sizes)).sum().backward()
        cp.all_reduce_gradients()
        y_all = cp.gather(y_r.detach())
    return {"y_r": y_r.detach().numpy(), "x_grad_r": x_r.grad.numpy(), "y_all": y_all.numpy(),
            "grads": {k: p.grad.numpy() for k, p in model.named_parameters()}}


def encoder_inputs(n: int = 11):
    """float64 q, k, v, a mask where sample 1 has no real token at all, loss weights."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(BATCH, HEADS, LATENTS, 8, generator=g, dtype=torch.float64)
    k = torch.randn(BATCH, HEADS, n, 8, generator=g, dtype=torch.float64)
    v = torch.randn(BATCH, HEADS, n, 8, generator=g, dtype=torch.float64)
    mask = torch.rand(BATCH, n, generator=g) > 0.4
    mask[0, 0], mask[1] = True, False
    a = torch.randn(BATCH, HEADS, LATENTS, 8, generator=g, dtype=torch.float64)
    b = torch.randn(BATCH, HEADS, LATENTS, generator=g, dtype=torch.float64)
    return q, k, v, mask, a, b


def encoder_loss(z, lse, a, b):
    """Uses both outputs, so the L cotangent of B.5 is exercised; -inf rows excluded."""
    finite = torch.isfinite(lse)
    return (z * a).sum() + torch.where(finite, lse, torch.zeros_like(lse)).mul(b).sum()


def run_sharded_encoder(group, sizes: list[int]) -> dict:
    rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    q, k, v, mask, a, b = encoder_inputs(sum(sizes))
    sl = shard_slice(k.shape[2], rank, world, sizes)
    q = q.requires_grad_(True)
    k_r = k[:, :, sl].detach().requires_grad_(True)
    v_r = v[:, :, sl].detach().requires_grad_(True)
    z, lse = distributed_encode_with_lse(q, k_r, v_r, mask[:, sl], group=group, scale=0.7)
    encoder_loss(z, lse, a, b).div(world).backward()  # replicated loss: each rank's share
    return {"z": z.detach().numpy(), "lse": lse.detach().numpy(), "q_grad": q.grad.numpy(),
            "k_grad_r": k_r.grad.numpy(), "v_grad_r": v_r.grad.numpy()}


def relative_l2_loss(y, target, mask, group=None):
    """Mean over samples of ||y - target|| / ||target|| over real points (global sums)."""
    keep = (torch.ones(y.shape[:2], dtype=torch.bool) if mask is None else mask)[..., None]
    err = ((y - target) ** 2 * keep).sum(dim=(1, 2))
    ref = (target ** 2 * keep).sum(dim=(1, 2))
    if group is not None:
        err, ref = global_sum(err, group), global_sum(ref, group)
    return (err.sqrt() / ref.sqrt()).mean()


def train_steps(model, x, target, mask, steps, group=None, cp=None) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = relative_l2_loss(model(x, mask), target, mask, group)
        (loss / (1 if cp is None else cp.world_size)).backward()
        if cp is not None:
            cp.all_reduce_gradients()
        optimizer.step()
        losses.append(loss.item())
    return losses


def run_sharded_training(group) -> dict:
    model = make_model("flarepp", "float64", seed=torch.distributed.get_rank(group))
    x, target, mask = make_batch(19, "float64", masked=True)
    with context_parallel(model, group) as cp:
        losses = train_steps(model, cp.shard(x), cp.shard(target), cp.shard(mask), 3,
                             group, cp)
    return {"losses": losses, "params": {k: p.detach().numpy()
                                         for k, p in model.named_parameters()}}


def run_bad_batch(group) -> str:
    """Ranks disagree on B: the encoder's shape check (a debug check, asked for here)
    must raise on every rank."""
    rank = torch.distributed.get_rank(group)
    model = make_model("flare", "float32")
    x = torch.randn(2 + rank, 5, IN_DIM)
    with context_parallel(model, group, check_shapes=True):
        try:
            model(x)
        except RuntimeError as err:
            return str(err)
    return "no error"


# ---------------------------------------------------------------- the spawned programs

CASES_R2 = (
    [dict(mixer=m, dtype="float64", n=23, masked=masked, sizes={2: [15, 8]})
     for m in SHARDABLE for masked in (False, True)]
    + [dict(mixer=m, dtype="float32", n=23, masked=True) for m in ("flare", "flarepp")]
    + [dict(mixer="flarepp", dtype="float64", n=13, masked=True, sizes={2: [13, 0]})]
    + [dict(mixer="luna", model=dict(arch="luna"), dtype="float64", n=23, masked=True)]
)
CASES_R3 = (
    [dict(mixer=m, dtype="float64", n=17, masked=True, sizes={3: [9, 0, 8]})
     for m in ("flare", "flarepp")]
    + [dict(mixer="flarepp", dtype="float64", n=20, masked=False)]
    + [dict(mixer="flarepp", dtype="float32", n=2, masked=False)]  # 3 ranks, 2 tokens
)


def run_bad_config(group) -> str:
    """Rank 1 builds its model with one latent more than rank 0."""
    rank = torch.distributed.get_rank(group)
    try:
        context_parallel(make_model("flarepp", "float32", latents=LATENTS + rank), group)
    except ValueError as err:
        return str(err)
    return "no error"


def run_trainer_and_cli(group, paths: dict) -> None:
    """The trainer on a (dp=1, cp=2) mesh (rank 0 writes), then ``flarepp infer
    --context-parallel --chunk-size 7`` as torchrun would run it (the group already exists,
    so the command must reuse it and leave it alone)."""
    from flarepp.cli import main
    from flarepp.train import Trainer
    from torch.distributed.device_mesh import init_device_mesh

    from flarepp.distributed.mesh import plan_for_mesh
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
    Trainer(trainer_config(paths["data"]), paths["cp_run"], progress=False,
            parallel=plan_for_mesh(mesh)).fit()
    os.environ.update(RANK=str(torch.distributed.get_rank(group)), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    assert main(["infer", paths["checkpoint"], "--data", paths["data"], "--out",
                 paths["cp_pred"], "--context-parallel", "--chunk-size", "7"]) == 0


def program_r2(group, paths: dict) -> dict:
    results = {"cases": [run_sharded(group, c) for c in CASES_R2],
               "encoder": run_sharded_encoder(group, [7, 4]),
               "training": run_sharded_training(group),
               "bad_batch": run_bad_batch(group),
               "bad_config": run_bad_config(group)}
    run_trainer_and_cli(group, paths)
    return results


def program_r3(group) -> dict:
    from flarepp.distributed import stream_forward
    rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    model = make_model("flarepp", "float64", seed=0)
    x, _, mask = make_batch(23, "float64", masked=True)
    sl = shard_slice(23, rank, world, [12, 0, 11])
    y_r = stream_forward(model, x[:, sl], mask[:, sl], chunk_size=5, group=group)
    return {"cases": [run_sharded(group, c) for c in CASES_R3],
            "encoder": run_sharded_encoder(group, [5, 0, 6]),
            "streamed": gather_tokens(y_r, group).numpy()}


def trainer_config(data: str):
    from flarepp.train import RunConfig
    return RunConfig(name="cp-test", dataset="npz", data_root=data,
                     model=dict(mixer="flarepp", dim=DIM, heads=HEADS, latents=LATENTS,
                                blocks=BLOCKS), epochs=2, batch_size=2, checkpoint_every=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A user-format dataset (meshes of 20-31 points, so padded and masked) and a
    single-process training run on it: the reference for the sharded trainer and infer."""
    from flarepp.train import Trainer
    root = tmp_path_factory.mktemp("cp")
    rng = np.random.default_rng(0)
    for split, count in (("train", 4), ("test", 3)):
        arrays = {}
        for i in range(count):
            pts = rng.random((int(rng.integers(20, 32)), 2)).astype(np.float32)
            arrays[f"x_{i}"] = pts
            arrays[f"y_{i}"] = np.sin(3 * pts[:, :1]) * np.cos(2 * pts[:, 1:])
        np.savez(root / f"{split}.npz", **arrays)
    Trainer(trainer_config(str(root)), root / "ref", progress=False).fit()
    return {"data": str(root), "ref_run": str(root / "ref"), "cp_run": str(root / "cp"),
            "checkpoint": str(root / "ref" / "checkpoints" / "epoch_0002.pt"),
            "cp_pred": str(root / "cp_pred.npz"), "root": root}


@pytest.fixture(scope="module")
def ranks_2(trained):
    paths = {k: v for k, v in trained.items() if isinstance(v, str)}
    return run_on_ranks(program_r2, 2, paths, timeout_s=90)


@pytest.fixture(scope="module")
def ranks_3():
    return run_on_ranks(program_r3, 3, timeout_s=90)


def assert_close(actual, expected, dtype: str, what: str) -> None:
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.isfinite(actual).all(), f"{what}: NaN or inf"
    err = float(np.abs(actual - expected).max(initial=0.0))
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


def check_cases(results: list[dict], cases: list[dict]) -> None:
    world = len(results)
    for i, case in enumerate(cases):
        ref, dtype = run_reference(case), case["dtype"]
        label = (f"{case['mixer']} {case.get('model', '')} {dtype} N={case['n']} "
                 f"masked={case['masked']} R={world}")
        assert_close(np.concatenate([r["cases"][i]["y_r"] for r in results], axis=1),
                     ref["y"], dtype, f"{label}: outputs")
        assert_close(np.concatenate([r["cases"][i]["x_grad_r"] for r in results], axis=1),
                     ref["x_grad"], dtype, f"{label}: input gradient")
        for rank, r in enumerate(results):
            assert_close(r["cases"][i]["y_all"], ref["y"], dtype, f"{label}: gathered outputs")
            assert r["cases"][i]["grads"].keys() == ref["grads"].keys()
            for name, g in r["cases"][i]["grads"].items():
                assert_close(g, ref["grads"][name], dtype, f"{label}: rank {rank} grad {name}")


def check_encoder(results: list[dict], n: int) -> None:
    q, k, v, mask, a, b = encoder_inputs(n)
    for t in (q, k, v):
        t.requires_grad_(True)
    z, lse = explicit_encode_lse(q, k, v, mask, scale=0.7)
    encoder_loss(z, lse, a, b).backward()
    for r in results:
        assert_close(r["z"], z.detach(), "float64", "distributed Z")
        assert np.array_equal(np.isneginf(r["lse"]), torch.isneginf(lse).numpy()), \
            "L = -inf exactly on rows without a real key"
        finite = torch.isfinite(lse).numpy()
        assert_close(r["lse"][finite], lse.detach().numpy()[finite], "float64", "distributed L")
    assert_close(sum(r["q_grad"] for r in results), q.grad, "float64", "dQ (sum of shares)")
    assert_close(np.concatenate([r["k_grad_r"] for r in results], axis=2), k.grad, "float64",
                 "dK")
    assert_close(np.concatenate([r["v_grad_r"] for r in results], axis=2), v.grad, "float64",
                 "dV")


# ---------------------------------------------------------------- tests

@pytest.mark.slow
def test_sharded_model_matches_single_process_2_ranks(ranks_2):
    """Outputs, input gradients and every rank's reduced parameter gradients equal the
    unsharded model for every shardable mixer, uneven and empty shards, with and without
    masks. A failure points at the merge (eq. 33), its backward (B.5), a double-counted or
    missing gradient reduction, or the weight broadcast of ``context_parallel``."""
    check_cases(ranks_2, CASES_R2)


@pytest.mark.slow
def test_sharded_model_matches_single_process_3_ranks(ranks_3):
    """As above at R=3 with an empty middle shard, and with more ranks than tokens (N=2):
    a failure points at empty-shard handling (L_r = -inf, Z_r = 0) or collective order."""
    check_cases(ranks_3, CASES_R3)


@pytest.mark.slow
def test_distributed_encoder_both_cotangents(ranks_2, ranks_3):
    """``distributed_encode_with_lse`` vs an explicit float64 softmax, with a loss on both
    Z and L and a sample with no real key: Z, L (-inf on empty rows), and dQ, dK, dV.
    A failure points at the L cotangent in the merge backward or the -inf guards."""
    check_encoder([r["encoder"] for r in ranks_2], 11)
    check_encoder([r["encoder"] for r in ranks_3], 11)


@pytest.mark.slow
def test_training_steps_match_single_process(ranks_2):
    """Three AdamW steps on a relative-L2 loss built with ``global_sum``: same losses and
    weights as one process. A failure points at ``global_sum``'s backward or the
    loss / world_size convention."""
    model = make_model("flarepp", "float64")
    x, target, mask = make_batch(19, "float64", masked=True)
    losses = train_steps(model, x, target, mask, 3)
    for rank, r in enumerate(ranks_2):
        np.testing.assert_allclose(r["training"]["losses"], losses, rtol=1e-10, atol=0)
        for name, p in model.named_parameters():
            assert_close(r["training"]["params"][name], p.detach(), "float64",
                         f"rank {rank} {name} after 3 steps")


@pytest.mark.slow
def test_streaming_within_shards_over_3_ranks(ranks_3):
    """Streaming in chunks inside each rank's shard, merged across ranks, equals the
    unchunked single-process forward: a failure points at ``stream_forward(group=...)``."""
    model = make_model("flarepp", "float64")
    x, _, mask = make_batch(23, "float64", masked=True)
    with torch.no_grad():
        assert_close(ranks_3[0]["streamed"], model(x, mask), "float64", "streamed outputs")


@pytest.mark.slow
def test_mismatched_batch_raises_on_every_rank(ranks_2):
    """Ranks with different B must get a clear error, not garbage from gloo."""
    for message in (r["bad_batch"] for r in ranks_2):
        assert "ranks disagree on the encoder's latent shape" in message


@pytest.mark.slow
def test_mismatched_configs_fail_fast(ranks_2):
    """Ranks built with different model configs must fail at wrap time, on every rank, with
    a message naming the differing key; never hang or train on inconsistent replicas."""
    for message in (r["bad_config"] for r in ranks_2):
        assert "the ranks hold different models" in message
        assert "rank 1 config latents=5 vs rank 0 4" in message


@pytest.mark.slow
def test_trainer_context_parallel_matches_single_process(ranks_2, trained):
    """Two epochs of the trainer with its meshes split over 2 ranks log the same losses and
    test errors as one process, and only rank 0 writes (one log line per epoch). A failure
    points at the trainer integration: token sharding, the loss shares, the gradient
    reduction or rank-0-only writes."""
    import json
    read = (lambda run: [json.loads(line) for line in
                         (Path(run) / "log.jsonl").read_text().splitlines()])
    ref, cp = read(trained["ref_run"]), read(trained["cp_run"])
    assert [r["epoch"] for r in cp] == [1, 2]
    for key in ("train_loss", "test_rel_l2"):
        np.testing.assert_allclose([r[key] for r in cp], [r[key] for r in ref], rtol=1e-5)
    assert (Path(trained["cp_run"]) / "checkpoints" / "epoch_0002.pt").is_file()


@pytest.mark.slow
def test_infer_cli_plain_streamed_and_sharded_agree(ranks_2, trained):
    """``flarepp infer`` plain, with chunk sizes that do and do not divide N, with the hidden
    state in a memory-mapped file, and with --context-parallel on 2 ranks (plus chunks)
    writes the same de-normalised ``pred`` to 1e-5, and ``rel_l2`` equal to the trainer's
    own test predictions."""
    from flarepp.cli import main
    root = trained["root"]
    preds = {}
    hidden = root / "hidden"
    hidden.mkdir(exist_ok=True)
    for name, extra in (("plain", []), ("divides", ["--chunk-size", "8"]),
                        ("ragged", ["--chunk-size", "7"]),
                        ("memmap", ["--chunk-size", "7", "--hidden-on", "memmap",
                                    "--memmap-dir", str(hidden)])):
        out = str(root / f"{name}.npz")
        assert main(["infer", trained["checkpoint"], "--data", trained["data"],
                     "--out", out, *extra]) == 0
        preds[name] = np.load(out)
    assert list(hidden.iterdir()) == []  # the memory-mapped hidden state is removed
    preds["sharded"] = np.load(trained["cp_pred"])
    reference = np.load(Path(trained["ref_run"]) / "test_predictions.npz")
    for name, found in preds.items():
        assert_close(found["pred"], reference["pred"], "float32", f"infer {name}: pred")
        np.testing.assert_allclose(found["rel_l2"], reference["rel_l2"], rtol=1e-5)
    # Inputs without targets: predictions only.
    test = np.load(Path(trained["data"]) / "test.npz")
    inputs = str(root / "inputs.npz")
    np.savez(inputs, x=_padded_inputs(test), mask=preds["plain"]["mask"])
    out = str(root / "inputs_pred.npz")
    assert main(["infer", trained["checkpoint"], "--data", inputs, "--out", out,
                 "--chunk-size", "5"]) == 0
    found = np.load(out)
    assert "rel_l2" not in found.files
    assert_close(found["pred"], reference["pred"], "float32", "infer inputs-only: pred")


def _padded_inputs(split) -> np.ndarray:
    """The per-sample ``x_i`` of a user-format file, zero-padded to ``[S, N_max, in]``."""
    xs = [split[f"x_{i}"] for i in range(len([k for k in split.files if k.startswith("x_")]))]
    out = np.zeros((len(xs), max(len(x) for x in xs), xs[0].shape[1]), np.float32)
    for i, x in enumerate(xs):
        out[i, :len(x)] = x
    return out


def run_dying_rank(group) -> None:
    model = make_model("flare", "float32")
    with context_parallel(model, group):
        if torch.distributed.get_rank(group) == 1:
            os._exit(3)
        model(torch.randn(2, 5, IN_DIM))


@pytest.mark.slow
def test_dead_rank_is_an_error_not_a_hang():
    """A rank that dies mid-run must surface as an error on the others (gloo's closed
    connection or the group's timeout), not a hang: a failure points at a missing timeout."""
    with pytest.raises(RankFailure) as err:
        run_on_ranks(run_dying_rank, 2, timeout_s=60, collective_timeout_s=10)
    assert "rank 1 exited with code 3" in str(err.value)
    assert "rank 0 raised" in str(err.value)


@pytest.mark.parametrize("mixer", NOT_SHARDABLE)
def test_unshardable_mixers_are_refused(mixer):
    """Mixers outside the token-shardable registry (full attention) must be refused with a
    clear error before any collective, instead of computing per-shard attention."""
    model = build_model(mixer=mixer, in_dim=IN_DIM, out_dim=OUT_DIM, dim=DIM, heads=HEADS,
                        latents=LATENTS, blocks=1)
    with pytest.raises(ValueError, match="cannot be split exactly"):
        context_parallel(model, group=None)


@pytest.mark.parametrize("arch", NOT_SHARDABLE_MODELS)
def test_unshardable_models_are_refused(arch):
    """Registered architectures not declared token-shardable (global layers outside the
    latent encode) must be refused before any collective."""
    with pytest.raises(ValueError, match="cannot be split exactly|not known to be pointwise"):
        context_parallel(build_model(arch=arch, in_dim=IN_DIM, out_dim=OUT_DIM), group=None)


@pytest.mark.parametrize("masked", [False, True])
def test_lse_backward_matches_explicit_reference(masked):
    """``encode_with_lse``'s fused backward with cotangents on both Z and L vs autograd
    through an explicit float64 softmax; a failure points at the padded-column trick of
    ``_FusedEncodeWithLSE`` (B.5's local backward), which the merge relies on."""
    q, k, v, mask, a, b = encoder_inputs(13)
    mask = mask if masked else None
    grads = []
    for fn in (lambda *t: encode_with_lse(*t, mask, scale=0.7),
               lambda *t: explicit_encode_lse(*t, mask, scale=0.7)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        z, lse = fn(*leaves)
        encoder_loss(z, lse, a, b).backward()
        grads.append([z.detach(), lse.detach()] + [t.grad for t in leaves])
    for name, got, want in zip(["Z", "L", "dQ", "dK", "dV"], *grads):
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)), f"{name}: -inf pattern"
        assert_close(got[finite].numpy(), want[finite].numpy(), "float64", name)
