"""The split step against a plain backward of the whole model, the merge (averaging and the
Trainer-step form of it), round replay, config validation, and the CLI's one-line errors."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import typer
from typer.testing import CliRunner

from unbroken.split import data, train
from unbroken.split.command import split_app
from unbroken.split.config import SplitConfig
from unbroken.split.errors import SplitInputError
from unbroken.split.job import RoundStream, merge_loss
from unbroken.split.model import build, split_step
from unbroken.split.plan import rounds


@pytest.fixture(autouse=True)
def one_thread():
    """As a cluster worker runs: tiny matmuls on a busy 2-core box are slower with more threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def digits():
    return data.digits()


def test_split_step_equals_a_plain_step():
    """Sending activations and returning their gradient changes nothing: same update as one backward."""
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    a, b = build(64, 10, 16, seed=1), build(64, 10, 16, seed=1)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        split_step(a, opt_a, x, y)
        opt_b.zero_grad()
        F.cross_entropy(b(x), y).backward()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6)


def test_merge_loss_gradient_steps_to_the_mean():
    """SGD(lr=1) on the mean over 'ranks' of merge_loss's gradient lands on the clusters' average."""
    merged = build(8, 3, 4, seed=0)
    locals_ = [build(8, 3, 4, seed=s) for s in (1, 2, 3)]
    grads = []
    for q in locals_:
        merged.zero_grad()
        merge_loss(merged, q).backward()
        grads.append([p.grad.clone() for p in merged.parameters()])
    want = train.average([q.state_dict() for q in locals_])
    with torch.no_grad():
        for i, (name, p) in enumerate(merged.named_parameters()):
            p -= torch.stack([g[i] for g in grads]).mean(0)
            torch.testing.assert_close(p, want[name], rtol=0, atol=1e-6)


def test_round_stream_replays_earlier_rounds(digits):
    cfg = SplitConfig(dataset="digits", clients=16, clusters=2, batch=16, merge_every=2, epochs=2.0)
    fed = train.federation(digits, cfg, "gcpsl-label")
    want = [rd.batches[1] for rd in rounds("gcpsl-label", fed, cfg)]
    s = RoundStream("gcpsl-label", fed, cfg, 1)
    for t in (1, 2, 3, 3, 2, 5, 1):  # a redo of round t, a process that joined later
        assert all(np.array_equal(a, b) for a, b in zip(s.batches(t), want[t - 1]))


def test_gpsl_learns_digits(digits):
    cfg = SplitConfig(dataset="digits", clients=16, clusters=2, batch=16, merge_every=4, epochs=3.0, hidden=32)
    curve, _ = train.run("gpsl", digits, cfg, train.federation(digits, cfg, "gpsl"))
    assert curve.final > 0.85 and curve.points[0][2] < curve.final
    assert curve.time_to(0.5) is not None and curve.time_to(1.01) is None


@pytest.mark.parametrize("kw, msg", [
    (dict(clusters=5, clients=4), "5 clusters for 4 clients"),
    (dict(batch=0), "--batch must be an integer >= 1"),
    (dict(p_drop=1.0), "--p-drop must be in"),
    (dict(dataset="mnist"), "unknown dataset"),
])
def test_config_validation(kw, msg):
    with pytest.raises(SplitInputError, match=msg):
        SplitConfig(**kw)


def _cli(*args):
    app = typer.Typer()
    app.add_typer(split_app, name="split")
    return CliRunner().invoke(app, ["split", "train", *[str(a) for a in args]])


@pytest.mark.parametrize("args, msg", [
    (["--clusters", "9", "--clients", "8"], "9 clusters for 8 clients"),
    (["--method", "gpsl", "--batch", "4"], "batch size 4 is smaller than the 10 classes"),
    (["--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"], "CIFAR-10 directory /nonexistent/cifar does not"),
    (["--method", "mystery"], "unknown method"),
])
def test_cli_bad_input_is_one_line_exit_2(args, msg, tmp_path):
    r = _cli("--dataset", "digits", "--out", tmp_path, *args)
    assert r.exit_code == 2, r.output
    assert msg in r.output and r.output.count("\n") == 1 and "Traceback" not in r.output


def test_cli_cluster_without_clients(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([0, 1, 0, 1] * 4))
    r = _cli("--dataset", "digits", "--clients", 16, "--clusters", 3, "--assignment", tmp_path / "a.json",
             "--out", tmp_path)
    assert r.exit_code == 2 and "cluster 2 has no clients" in r.output


def test_cli_trains_an_inprocess_method(tmp_path):
    r = _cli("--dataset", "digits", "--method", "psl", "--clients", 16, "--batch", 16, "--epochs", 1,
             "--out", tmp_path)
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "psl.json").read_text())
    assert res["final_accuracy"] == res["curve"][-1][2] and 0 < res["participation"]["samples"] <= 1


def test_bench_target_is_the_serialized_settled_level_not_its_last_round():
    """The target is the median of the last third of rounds (pooled over repeats), floored to a
    point: a last-round dip (0.79 after 0.82-0.84) does not lower it, and the serialized runs
    reach it."""
    from unbroken.bench.split import target_of
    from unbroken.split.train import Curve

    accs = [0.70, 0.75, 0.80, 0.81, 0.83, 0.82, 0.835, 0.824, 0.837, 0.793]
    curve = Curve([(i + 1, float(i), a) for i, a in enumerate(accs)])
    target = target_of([curve, curve])
    assert target == 0.82  # last third (3 rounds): 0.824 0.837 0.793 -> median 0.824
    assert curve.time_to(target) == 4.0
    assert target_of([Curve([(1, 0.0, 0.5)])]) == 0.5
