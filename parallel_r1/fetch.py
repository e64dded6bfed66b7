"""Download a published dataset file at a pinned commit and convert it into the mirror's layout.

Two kinds of source (parallel_r1/data_manifest.yaml): a Hugging Face Hub dataset file, fetched with
`huggingface_hub.hf_hub_download` (it honours HF_ENDPOINT, follows the Hub's CDN and Xet redirects and
resumes a dropped transfer within the call), and a file of a GitHub repository, fetched from
raw.githubusercontent.com (env PARALLEL_R1_GITHUB_RAW overrides the base URL; a Git LFS pointer is followed to
media.githubusercontent.com, PARALLEL_R1_GITHUB_LFS) by a small downloader that resumes a `.part` file with a
Range request, across runs too. Both write only under the download cache; a source file appears there whole or
not at all, so an interrupted download never reaches the conversion.

The converters rebuild the mirror's bytes from the published schema (one JSON object per line,
`ensure_ascii=False`, keys in the mirror's order); mirror.py checks the result against the manifest's sha256
before it becomes a mirror file.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from parallel_r1.errors import PipelineError

HUB_DEFAULT = "https://huggingface.co"
GITHUB_RAW_DEFAULT = "https://raw.githubusercontent.com"
GITHUB_LFS_DEFAULT = "https://media.githubusercontent.com/media"
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"
ATTEMPTS = 3            # GitHub downloads: tries within one run, each resuming where the last one stopped
TIMEOUT_S = 60


def source_url(source: dict) -> str:
    """Where `source` (a manifest entry's `source`) is published, as a URL."""
    if source["kind"] == "hub_dataset":
        base = os.environ.get("HF_ENDPOINT") or HUB_DEFAULT
        return f"{base.rstrip('/')}/datasets/{source['repo']}/resolve/{source['revision']}/{source['path']}"
    base = os.environ.get("PARALLEL_R1_GITHUB_RAW") or GITHUB_RAW_DEFAULT
    return f"{base.rstrip('/')}/{source['repo']}/{source['revision']}/{source['path']}"


def download(source: dict, cache: Path, label: str) -> Path:
    """The published file `source`, downloaded into `cache` (kept there: one download serves several mirror
    files). `label` names the mirror file in errors. One-line PipelineError when it cannot be fetched."""
    if not source.get("revision") or not source.get("path"):
        raise PipelineError(f"{label}: no pinned revision for {source['repo']} in the data manifest, so it "
                            f"cannot be downloaded; point PARALLEL_R1_DATA at a mirror that holds it")
    url = source_url(source)
    pinned = f"{source['repo'].replace('/', '__')}@{source['revision']}"
    target = cache / source["kind"] / pinned / source["path"]
    if target.is_file():
        return target
    _check_reachable(url, source["kind"], label)
    if source["kind"] == "hub_dataset":
        return _hub_download(source, target, url, label)
    return _github_download(source, target, url, label)


def _check_reachable(url: str, kind: str, label: str) -> None:
    """Fail at once, naming the URL, when its host cannot be reached (the Hub client would back off ~20 s);
    behind a proxy (HTTPS_PROXY...) the clients' own errors say it instead."""
    if kind == "hub_dataset" and os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false"):
        raise PipelineError(f"{label}: HF_HUB_OFFLINE is set, so {url} cannot be fetched; unset it, or point "
                            f"PARALLEL_R1_DATA at a mirror (or put one at ../shared/data)")
    parts = urlsplit(url)
    if parts.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(parts.hostname or ""):
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=10).close()
    except OSError as err:
        raise PipelineError(f"{label}: cannot reach {url} ({err.strerror or err}); offline? Point "
                            f"PARALLEL_R1_DATA at a mirror of the datasets (or put one at "
                            f"../shared/data)") from None


def _hub_download(source: dict, target: Path, url: str, label: str) -> Path:
    from huggingface_hub import hf_hub_download

    root = target.parents[len(Path(source["path"]).parts) - 1]
    try:
        path = hf_hub_download(source["repo"], source["path"], repo_type="dataset",
                               revision=source["revision"], local_dir=root,
                               endpoint=os.environ.get("HF_ENDPOINT") or HUB_DEFAULT)
    except Exception as err:  # noqa: BLE001 -- any failure of the client: one line naming the URL
        raise PipelineError(f"{label}: download of {url} failed ({_first_line(err)}); nothing was written, "
                            f"run `make data` again") from None
    return Path(path)


def _github_download(source: dict, target: Path, url: str, label: str) -> Path:
    part = target.with_name(target.name + ".part")
    _fetch_resuming(url, part, label)
    with open(part, "rb") as handle:
        pointer = handle.read(len(LFS_POINTER)) == LFS_POINTER
    if pointer:   # the repository stores it in Git LFS: raw.githubusercontent serves the pointer
        part.unlink()
        base = os.environ.get("PARALLEL_R1_GITHUB_LFS") or GITHUB_LFS_DEFAULT
        lfs_url = f"{base.rstrip('/')}/{source['repo']}/{source['revision']}/{source['path']}"
        _fetch_resuming(lfs_url, part, label)
    part.replace(target)
    return target


def _fetch_resuming(url: str, part: Path, label: str) -> None:
    """`url` into `part`, appending from its current size (Range): a dropped transfer resumes, here or in the
    next run. Complete when the server's length is reached; one line after ATTEMPTS failures."""
    part.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, ATTEMPTS + 1):
        have = part.stat().st_size if part.is_file() else 0
        request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                if have and response.status != 206:   # the server ignored the Range: start again
                    have = 0
                total = _total_length(response, have)
                with open(part, "ab" if have else "wb") as out:
                    while chunk := response.read(1 << 20):
                        out.write(chunk)
            size = part.stat().st_size
            if total is None or size == total:
                return
            reason = f"got {size} of {total} bytes"
            if size > total:                      # not a prefix of this file: start again
                part.unlink()
        except urllib.error.HTTPError as err:
            if err.code == 416 and have:          # nothing past `have`: complete, or not this file's prefix
                if err.headers.get("Content-Range", "").endswith(f"/{have}"):
                    return
                part.unlink()
            reason = f"HTTP {err.code} {err.reason}"
            if err.code in (401, 403, 404):
                break
        except (OSError, http.client.HTTPException) as err:   # refused, reset, timed out, closed mid-body
            reason = str(getattr(err, "reason", None) or err) or type(err).__name__
        if attempt < ATTEMPTS:
            time.sleep(0.5 * attempt)
    kept = f"; {part.stat().st_size} bytes kept in {part} for the next run" if part.is_file() else ""
    raise PipelineError(f"{label}: download of {url} failed ({reason}); no mirror file was written{kept}")


def _total_length(response: Any, have: int) -> int | None:
    """The whole file's length, from Content-Range (a 206) or Content-Length plus what is already there."""
    content_range = response.headers.get("Content-Range", "")
    if "/" in content_range and content_range.rsplit("/", 1)[1].isdigit():
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return int(length) + have if length and length.isdigit() else None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200]}" if text else type(err).__name__


# --- conversion: published rows -> the mirror's rows ---

def read_rows(path: Path) -> list[dict]:
    """The rows of a published file: parquet (pyarrow) or JSON lines."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _gsm8k(rows: list[dict], split: str) -> list[dict]:
    """GSM8K's question and answer; the truth is the answer after `####`, commas dropped."""
    return [{"id": f"gsm8k-{split}-{index}", "question": row["question"], "answer": row["answer"],
             "ground_truth": row["answer"].split("####")[-1].strip().replace(",", "")}
            for index, row in enumerate(rows)]


def _math500(rows: list[dict]) -> list[dict]:
    return [{"id": row["unique_id"], "problem": row["problem"], "ground_truth": row["answer"],
             "subject": row["subject"], "level": row["level"]} for row in rows]


def _verl_eval(rows: list[dict], data_source: str, id_prefix: str) -> list[dict]:
    """One benchmark of a VERL evaluation file: its rows, each problem once (the file repeats every problem
    for mean@k), the problem text after the prompt's last `Problem:`."""
    seen: dict[tuple[str, str], None] = {}
    for row in rows:
        if row["data_source"] == data_source:
            problem = row["prompt"][0]["content"].split("Problem:")[-1].strip()
            seen.setdefault((problem, str(row["reward_model"]["ground_truth"])), None)
    return [{"id": f"{id_prefix}-{index}", "problem": problem, "ground_truth": truth}
            for index, (problem, truth) in enumerate(seen)]


CONVERTERS: dict[str, Callable[..., list[dict]]] = {"gsm8k": _gsm8k, "math500": _math500,
                                                    "verl_eval": _verl_eval}


def convert(rows: list[dict], spec: dict | None, label: str) -> bytes:
    """The mirror file's bytes for `rows` under the manifest's `convert` entry."""
    if not spec or spec.get("kind") not in CONVERTERS:
        raise PipelineError(f"{label}: no conversion for its source in the data manifest; point "
                            f"PARALLEL_R1_DATA at a mirror that holds it")
    options = {key: value for key, value in spec.items() if key != "kind"}
    try:
        converted = CONVERTERS[spec["kind"]](rows, **options)
    except (KeyError, IndexError, TypeError, AttributeError) as err:
        raise PipelineError(f"{label}: the downloaded file does not have the schema its `{spec['kind']}` "
                            f"conversion reads ({type(err).__name__}: {err})") from None
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in converted).encode("utf-8")
