"""A local two-node Ray cluster for the tests: ``recipes/local_ray_cluster.sh`` (the commands a user runs).

``with LocalCluster(root, env) as cluster:`` starts it and always stops it (``cluster.stopped`` is the stop
command's result: it fails when a Ray process or a listening port is left; ``cluster.runtime_envs_left`` lists
the runtime envs the stop left in the cluster's own temp dirs, which are then removed). ``cluster.submit(...)`` runs
``recipes/submit_ray_job.sh`` (inside the cluster's network namespace: ``local_ray_cluster.sh exec``) and collects the logs of every actor that ran on the worker node through Ray's
state API (``get_log(actor_id=...)``: the log the node that ran the actor holds).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClusterRun", "LocalCluster"]

BASE_PORT = os.environ.get("RLALIGN_TEST_RAY_BASE_PORT", "28400")

_ACTOR_LOGS = r"""
import json, sys
from ray.util.state import get_log, list_actors, list_nodes
address = sys.argv[1]
nodes = list_nodes(address=address, detail=True)
workers = [n.node_id for n in nodes if n.resources_total.get("GPU", 0) > 0]
out = {"worker_nodes": workers, "actors": []}
for actor in list_actors(address=address, detail=True, limit=1000):
    text = ""
    if actor.node_id in workers:
        try:
            text = "".join(get_log(address=address, actor_id=actor.actor_id, tail=-1, suffix="err"))
            text += "".join(get_log(address=address, actor_id=actor.actor_id, tail=-1, suffix="out"))
        except Exception as e:  # a dead actor whose log is gone: say so
            text = f"<no log: {e}>"
    out["actors"].append({"class": actor.class_name, "node": actor.node_id, "state": actor.state, "log": text})
print(json.dumps(out))
"""


@dataclass
class ClusterRun:
    """One submitted job: the submit command's result, the run's ``out`` dir and the worker node's actor logs."""

    out: Path
    job: subprocess.CompletedProcess
    actors: list[dict]
    failed: subprocess.CompletedProcess | None = None
    stop: subprocess.CompletedProcess | None = None
    home: Path | None = None
    runtime_envs_left: list[str] | None = None

    @property
    def worker_node_logs(self) -> str:
        return "\n".join(a["log"] for a in self.actors if a["log"])


class LocalCluster:
    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        # temp dirs of its own (short: Ray's socket paths stay under 108 bytes), removed after the stop
        self.temp_dir = Path(f"/tmp/rla-ray-{os.getpid()}")
        self.env = dict(env, BASE_PORT=BASE_PORT, RAY_AUTH_MODE="token", RAY_TEMP_DIR=str(self.temp_dir))
        self.runtime_envs_left: list[str] = []
        self.address = ""  # the Jobs API (dashboard)
        self.gcs = ""  # the state API
        self.stopped: subprocess.CompletedProcess | None = None

    def _script(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", *args],
            cwd=self.root,
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def __enter__(self) -> LocalCluster:
        started = self._script("recipes/local_ray_cluster.sh", "start")
        if started.returncode != 0:
            self.__exit__(None, None, None)
            raise RuntimeError(f"local cluster did not start: {started.stderr[-3000:]}")
        said = dict(line.split("=", 1) for line in started.stdout.split() if "=" in line)
        self.address, self.gcs = said["RAY_ADDRESS"], said["GCS_ADDRESS"]
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped = self._script("recipes/local_ray_cluster.sh", "stop")
        temp_dirs = (self.temp_dir, Path(f"{self.temp_dir}-worker"))
        self.runtime_envs_left = [str(p) for d in temp_dirs for p in d.glob("session_*/runtime_resources")]
        for d in temp_dirs:
            shutil.rmtree(d, ignore_errors=True)

    def submit(self, recipe: str, overrides: list[str], env: dict[str, str], out: Path) -> ClusterRun:
        job_env = dict(
            env,
            BASE_PORT=BASE_PORT,
            RAY_AUTH_MODE="token",
            RAY_ADDRESS=self.address,
            RAY_TEMP_DIR=str(self.temp_dir),
        )
        # clients run where the cluster's network is (its namespace, when it has one)
        inside = ["recipes/local_ray_cluster.sh", "exec"]
        job = self._script(
            *inside, "bash", "recipes/submit_ray_job.sh", recipe, *overrides, env=job_env, timeout=2700
        )
        out.mkdir(parents=True, exist_ok=True)
        (out / "submit.log").write_text(job.stdout + job.stderr)
        logs = self._script(*inside, sys.executable, "-c", _ACTOR_LOGS, self.gcs, env=job_env)
        if logs.returncode != 0:
            raise RuntimeError(f"reading the actor logs failed: {logs.stderr[-3000:]}")
        actors = json.loads(logs.stdout.strip().splitlines()[-1])["actors"]
        (out / "worker_node_actors.json").write_text(json.dumps(actors, indent=1))
        return ClusterRun(out, job, actors)
