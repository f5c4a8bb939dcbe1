"""`unbroken store start|stop`: a local 3-member etcd cluster for `unbroken run --store` (runtime/etcd_cluster.py)."""
from __future__ import annotations

from pathlib import Path

import typer

from unbroken.cli_error import fail
from unbroken.runtime import etcd_cluster

store_app = typer.Typer(no_args_is_help=True, help="A replicated store for multi-node jobs: a local 3-member etcd "
                                                   "cluster (Debian: apt-get install etcd-server; pip install etcd3gw).")


@store_app.command("start")
def start(directory: Path = typer.Option(..., "--dir", help="where the members keep their data, logs and "
                                                            "cluster.json (tmpfs, e.g. /dev/shm/..., is fastest)"),
          members: int = typer.Option(3, "--members", help="members (odd: 3 survives the loss of any one)"),
          base_port: int = typer.Option(0, "--base-port", help="client/peer ports from here up (2 per member); "
                                                               "0: free ones"),
          job: str = typer.Option("job", "--job", help="the key prefix the printed URL names (one per job)")) -> None:
    """Start the cluster and print the --store URL for `unbroken run`; it runs until `unbroken store stop`."""
    if members < 1 or members % 2 == 0:
        fail(f"--members must be odd and >= 1 (a majority must survive a loss), got {members}; e.g. --members 3")
    if base_port and not 1024 <= base_port <= 65535 - 2 * members:
        fail(f"--base-port {base_port} leaves no room for {2 * members} ports; pick 1024..{65535 - 2 * members}")
    try:
        started = etcd_cluster.start(directory, members=members, base_port=base_port)
    except etcd_cluster.ClusterError as e:
        fail(str(e))
    for m in started:
        typer.echo(f"member {m.name}: pid {m.pid}, client {m.endpoint}, peer 127.0.0.1:{m.peer_port}", err=True)
    typer.echo(etcd_cluster.url(started, job))


@store_app.command("stop")
def stop(directory: Path = typer.Option(..., "--dir", help="the directory `unbroken store start` used"),
         keep_data: bool = typer.Option(False, "--keep-data", help="keep the members' data directories")) -> None:
    """Stop every member (SIGTERM, then SIGKILL) and wait until each has exited."""
    try:
        stopped = etcd_cluster.stop(directory, keep_data=keep_data)
    except etcd_cluster.ClusterError as e:
        fail(str(e))
    typer.echo(f"stopped {len(stopped)} etcd member(s): pids {', '.join(str(m.pid) for m in stopped)}", err=True)
