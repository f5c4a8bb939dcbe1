"""A node's place from its launcher's environment (runtime/cluster_env.py): Slurm host lists, precedence, bad values."""
import pytest
from hypothesis import given, strategies as st

from unbroken.runtime.cluster_env import (SLURM_PORT_BASE, ClusterEnvError, expand_hostlist, first_host, from_env)

prefix = st.from_regex(r"[a-z][a-z0-9-]{0,6}[a-z]", fullmatch=True)


@given(prefix, st.lists(st.integers(0, 300), min_size=1, max_size=12, unique=True), st.integers(1, 4))
def test_a_bracketed_list_expands_to_its_hosts_in_order(head, numbers, width):
    spec = f"{head}[{','.join(f'{n:0{width}d}' for n in numbers)}]"
    padded = width if width > 1 else 0
    assert expand_hostlist(spec) == [f"{head}{n:0{padded}d}" if n < 10 ** width else f"{head}{n}" for n in numbers]


@given(prefix, st.integers(0, 50), st.integers(0, 20), prefix)
def test_ranges_expand_and_plain_names_pass_through(head, a, n, other):
    spec = f"{head}[{a}-{a + n}],{other}"
    assert expand_hostlist(spec) == [f"{head}{i}" for i in range(a, a + n + 1)] + [other]
    assert first_host(spec) == f"{head}{a}"


def test_nested_brackets_zero_padding_and_addresses():
    assert expand_hostlist("rack[1-2]-n[01-02]") == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
    assert expand_hostlist("gpu[08-10]") == ["gpu08", "gpu09", "gpu10"]
    assert first_host("10.77.0.[1-2]") == "10.77.0.1"


@pytest.mark.parametrize("spec,needle", [("", "names no host"), ("n[1-", "unmatched '['"), ("n]1", "unmatched ']'"),
                                         ("n[3-1]", "runs backwards"), ("n[a]", "is not N or N-M")])
def test_a_broken_host_list_is_named(spec, needle):
    with pytest.raises(ClusterEnvError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        expand_hostlist(spec)


def test_slurm_gives_node_count_index_first_host_and_a_port_every_node_agrees_on():
    env = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_JOB_ID": "4242"}
    p = from_env(env)
    assert (p.nnodes, p.node_rank, p.host, p.port, p.source) == (4, 2, "gpu07", SLURM_PORT_BASE + 4242, "slurm")
    assert from_env({**env, "SLURM_NODEID": "0"}).port == p.port


def test_torchrun_variables_win_over_pet_and_slurm():
    env = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "NNODES": "2", "GROUP_RANK": "1",
           "PET_MASTER_ADDR": "pet-host", "PET_NNODES": "8", "SLURM_NNODES": "3", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "x[1-3]"}
    p = from_env(env)
    assert (p.nnodes, p.node_rank, p.host, p.port) == (2, 1, "10.0.0.5", 29500)
    assert p.source == "torchrun+pet+slurm"


def test_kubernetes_pet_variables_give_the_world_from_nodes_times_processes():
    p = from_env({"PET_NNODES": "2:4", "PET_NODE_RANK": "3", "PET_MASTER_ADDR": "job-master-0",
                  "PET_MASTER_PORT": "23456", "PET_NPROC_PER_NODE": "2"})
    assert (p.nnodes, p.node_rank, p.host, p.port, p.world_size) == (4, 3, "job-master-0", 23456, 8)


def test_an_empty_environment_says_nothing():
    assert from_env({}) == from_env({"UNRELATED": "1"})
    assert from_env({}).source == "none" and from_env({}).nnodes is None


@pytest.mark.parametrize("env,needle", [({"SLURM_NODEID": "one"}, "SLURM_NODEID='one' is not an integer"),
                                        ({"PET_NNODES": "a:b"}, "neither N nor MIN:MAX"),
                                        ({"MASTER_PORT": "http"}, "MASTER_PORT='http'")])
def test_a_variable_that_is_not_a_number_is_named(env, needle):
    with pytest.raises(ClusterEnvError, match=needle):
        from_env(env)
