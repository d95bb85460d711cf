"""A package's source distribution from a PyPI-style index, and files read out of it (for ``gpu_bundle.py``).

:func:`sdist_info` asks the index's JSON API (``{index}/{name}/{version}/json``, else the project endpoint)
for the sdist's URL and sha256; :func:`fetch_sdist` downloads it once into the cache and checks the sha256
on every use; :func:`read_sources` reads files out of the tarball without extracting it;
:func:`include_closure` follows ``#include`` lines from seed files to every header they need.
Every refusal is a :class:`Refused` with a one-line reason. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path, PurePosixPath

PYPI_INDEX = "https://pypi.org/pypi"
"""PyPI's JSON API root: ``{index}/{name}/{version}/json`` and ``{index}/{name}/json``."""

_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


class Refused(Exception):
    """A one-line reason the bundle is not made (the builder exits 2)."""


def cache_dir() -> Path:
    """Where sdists and the index's answers are cached (``$RLALIGN_CACHE/sdist``)."""
    env = os.environ.get("RLALIGN_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "rlalign-verl"
    return base / "sdist"


def _get(url: str, timeout: float = 60) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "rlalign-verl-gpu-bundle"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def index_url(index: str | None = None) -> str:
    """The JSON API root used: ``index``, else ``$RLALIGN_PYPI_INDEX``, else :data:`PYPI_INDEX`."""
    return (index or os.environ.get("RLALIGN_PYPI_INDEX") or PYPI_INDEX).rstrip("/")


def _json(url: str, what: str) -> dict | None:
    """The JSON at ``url``; None on a 404; :class:`Refused` (one line) on anything else."""
    try:
        return json.loads(_get(url))
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise Refused(f"the index answered {exc.code} for {what}") from None
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
        raise Refused(f"cannot read the index for {what}: {exc}") from None


def _release_files(name: str, version: str, index: str) -> list[dict]:
    """The index's file list of ``name==version``: the release endpoint, else the project endpoint's
    ``releases`` (some PyPI front ends answer only the latter)."""
    url = f"{index}/{name}/{version}/json"
    release = _json(url, f"{name} {version}")
    if release is not None:
        return _absolute(url, release["urls"])
    url = f"{index}/{name}/json"
    project = _json(url, name)
    if project is None:
        raise Refused(f"{name} is not on the index ({index})")
    if version not in project.get("releases", {}):
        raise Refused(f"{name} {version} is not on the index ({index}): no such release")
    return _absolute(url, project["releases"][version])


def _absolute(endpoint: str, files: list[dict]) -> list[dict]:
    """File URLs made absolute (a PyPI mirror may answer them relative to the endpoint)."""
    return [{**f, "url": urllib.parse.urljoin(endpoint, f["url"])} for f in files]


def sdist_info(name: str, version: str, index: str | None = None) -> dict:
    """``{url, filename, sha256, size}`` of the sdist of ``name==version`` from the index (cached)."""
    cache = cache_dir() / f"{name}-{version}.json"
    if cache.is_file():
        files = json.loads(cache.read_text())
    else:
        files = _release_files(name, version, index_url(index))
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(files))
    sdists = [u for u in files if u.get("packagetype") == "sdist"]
    if not sdists:
        raise Refused(f"{name} {version} has no source distribution on the index (wheels only)")
    u = sdists[0]
    return {"url": u["url"], "filename": u["filename"], "sha256": u["digests"]["sha256"], "size": u["size"]}


def sha256(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def fetch_sdist(info: dict) -> Path:
    """The sdist file in the cache, downloaded once and checked against PyPI's sha256 every time."""
    path = cache_dir() / info["filename"]
    if path.is_file() and sha256(path.read_bytes()) == info["sha256"]:
        return path
    try:
        data = _get(info["url"], timeout=600)
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise Refused(f"cannot download {info['url']}: {exc}") from None
    if sha256(data) != info["sha256"]:
        raise Refused(f"{info['filename']}: sha256 {sha256(data)} is not the index's {info['sha256']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


# --- selection ------------------------------------------------------------------------------------------


def read_sources(sdist: Path, prefixes: tuple[str, ...]) -> tuple[str, dict[str, bytes]]:
    """``(top folder, {path inside the sdist: bytes})`` of the regular files under ``prefixes``."""
    files: dict[str, bytes] = {}
    top = None
    with tarfile.open(sdist, "r:*") as tar:
        for m in tar:
            parts = PurePosixPath(m.name).parts
            if len(parts) < 2 or not m.isfile():
                continue
            top = top or parts[0]
            rel = "/".join(parts[1:])
            if rel.startswith(prefixes) or rel in prefixes:
                f = tar.extractfile(m)
                assert f is not None
                files[rel] = f.read()
    if top is None:
        raise Refused(f"{sdist.name}: empty archive")
    return top, files


def include_closure(
    files: dict[str, bytes], seeds: tuple[str, ...], roots: tuple[str, ...]
) -> tuple[list[str], dict[str, list[str]]]:
    """Every file reachable from ``seeds`` through ``#include`` lines (quoted: the including file's folder
    first, then ``roots``; angled: ``roots``), and the includes found nowhere in the sdist (toolkit, torch)
    with the files that include them. Conditional includes are followed too (a superset is harmless)."""
    missing = [s for s in seeds if s not in files]
    if missing:
        raise Refused(f"the sdist lacks {missing}: this version's layout is not the one the check builds")
    seen: set[str] = set()
    external: dict[str, set[str]] = {}
    stack = list(seeds)
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        text = files[cur].decode("utf-8", errors="replace")
        for kind, name in _INCLUDE.findall(text):
            cands = [str(PurePosixPath(cur).parent / name)] if kind == '"' else []
            cands += [f"{r}/{name}" for r in roots]
            hit = next((c for c in map(_norm, cands) if c in files), None)
            if hit is None:
                external.setdefault(name, set()).add(cur)
            else:
                stack.append(hit)
    return sorted(seen), {k: sorted(v) for k, v in sorted(external.items())}


def _norm(path: str) -> str:
    return os.path.normpath(path).replace(os.sep, "/")
