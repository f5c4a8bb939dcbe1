"""The HTTP API on a free loopback port (always stopped): completions, 4xx errors that leave the
server serving, /metrics; and a fleet of two server processes behind the router."""
import json
import urllib.error
import urllib.request

import pytest
import torch

from unbroken.bench.common import free_port
from unbroken.serve.adapters import write_adapter
from unbroken.serve.api import build_app
from unbroken.serve.background import BackgroundApp
from unbroken.serve.config import ServeConfig, serve_model
from unbroken.serve.engine import Engine
from unbroken.serve.fleet import Fleet
from unbroken.serve.router import Router, build_router_app


def post(url, body, timeout=60):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    model = serve_model()
    write_adapter(d, "a0", model=model, rank=4, seed=0)
    write_adapter(d, "a1", model=model, rank=8, seed=1)
    write_adapter(d, "wide", model=model, rank=32, seed=2)
    write_adapter(d, "foreign", model=model, rank=4, seed=3, base="someone/other-model")
    return d


@pytest.mark.timeout(60)
def test_completions_errors_and_metrics(adapter_dir):
    torch.set_num_threads(1)
    with BackgroundApp(build_app(Engine(ServeConfig(), adapter_dir)), free_port()) as url:
        status, out = post(url, {"model": "a0", "prompt": "hello", "max_tokens": 5})
        assert status == 200 and out["usage"]["completion_tokens"] == 5 and len(out["choices"][0]["text"]) == 5
        assert out["metrics"]["ttft_s"] <= out["metrics"]["e2e_s"]
        bad = [({"model": "nope", "prompt": "x"}, 404, "unknown adapter"),
               ({"adapter": "wide", "prompt": "x"}, 400, "rank 32"),
               ({"model": "foreign", "prompt": "x"}, 400, "trained for base"),
               ({"model": "a1", "prompt": "x" * 60, "max_tokens": 8}, 400, "longer than the context"),
               ({"model": "a1", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
               (b"{not json", 400, "not JSON")]
        for body, code, text in bad:
            status, out = post(url, body)
            assert status == code and text in out["error"]["message"], (body, out)
        status, out = post(url, {"model": "a1", "prompt": "still here", "max_tokens": 3})
        assert status == 200  # the bad requests did not stop the server
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'unbroken_serve_requests_total{adapter="a1"} 1' in text
        assert "unbroken_serve_ttft_seconds_count 2" in text and "unbroken_serve_adapter_loads_total 2" in text
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            assert "a1" in {m["id"] for m in json.loads(r.read())["data"]}


@pytest.mark.timeout(120)
def test_router_sends_each_adapter_to_its_server(adapter_dir, tmp_path):
    ports = [free_port(), free_port()]
    with Fleet(adapter_dir, ports, ServeConfig(), log_dir=tmp_path) as urls:
        router = Router({"a0": [urls[0]], "a1": [urls[1]]})
        with BackgroundApp(build_router_app(router), free_port()) as rurl:
            for name in ("a0", "a1", "a0"):
                status, out = post(rurl, {"model": name, "prompt": "hi", "max_tokens": 2})
                assert status == 200 and out["model"] == name
            status, out = post(rurl, {"model": "wide", "prompt": "hi"})
            assert status == 404 and "no server hosts" in out["error"]["message"]
        assert router.sent == {urls[0]: 2, urls[1]: 1}
        for url, n in zip(urls, (2, 1)):
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                assert f"unbroken_serve_ttft_seconds_count {n}" in r.read().decode()


@pytest.mark.timeout(90)
def test_a_profile_fits_only_its_own_requests(tmp_path):
    """Profiling a real server over HTTP: the iterations it keeps are those its requests caused (a
    request sent before it is not among them), and the fitted costs are positive where the engine
    must spend time."""
    from unbroken.serve.profile import fit_profiles, profile, profiling_workload, write_profile_adapters

    torch.set_num_threads(1)
    write_profile_adapters(tmp_path)
    write_adapter(tmp_path, "a0", model=serve_model(), rank=4, seed=0)
    with BackgroundApp(build_app(Engine(ServeConfig(), tmp_path)), free_port()) as url:
        assert post(url, {"model": "a0", "prompt": "earlier", "max_tokens": 20})[0] == 200
        p = profile(url, phase_s=0.5)
    want = profiling_workload(0.5)
    assert sum(rec[0] for rec in p.iterations) == sum(a.gen_len for a in want)  # one row per token made
    assert len(p.admissions) == len(p.http_gaps) == len(want)
    costs = fit_profiles(p)
    assert costs.base + costs.token > 0 and len(costs.slowdown) == 20 and min(costs.slowdown) > 0
