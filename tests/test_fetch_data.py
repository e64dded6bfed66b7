"""`make data` (parallel_r1/mirror.py, fetch.py): the mirror from a local copy or from where each dataset is
published, every file checked against the data manifest before it is written.

A local HTTP server on 127.0.0.1 stands in for both publishers: the Hugging Face Hub's file URLs
(`/datasets/<repo>/resolve/<revision>/<path>`, with the headers `hf_hub_download` reads: X-Repo-Commit,
ETag, Content-Length, Range) and raw.githubusercontent.com's (`/<owner>/<repo>/<commit>/<path>`). It serves
small files in the published schemas (GSM8K's and the authors' VERL evaluation parquet, MATH-500's JSON
lines) under a test manifest whose hashes are those of the mirror files written out here by hand.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml

from parallel_r1 import mirror as data_mirror
from parallel_r1.data import SOURCES, TEACHER_DEMOS
from parallel_r1.errors import PipelineError

REPO = Path(__file__).resolve().parents[1]
HUB_REV, GITHUB_REV = "a" * 40, "b" * 40
APO_PATH = "code/data/APO_combine/test.parquet"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    return buffer.getvalue()


def jsonl(rows: list[dict]) -> bytes:
    """The mirror's format: one object per line, non-ASCII kept as it is."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")


GSM8K = [{"question": "Zoë’s shop sells 1,200 pens and 3 more. How many?",
          "answer": "1200+3=<<1200+3=1203>>1203\n#### 1,203"},
         {"question": "What is 2 + 2?", "answer": "2+2=<<2+2=4>>4\n#### 4"}]
MATH500 = [{"problem": "Compute $\\sqrt{16}$.", "solution": "It is $\\boxed{4}$.", "answer": "4",
            "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}]
APO = [{"data_source": source,
        "prompt": [{"role": "user", "content": f"Think in parallel.\n\nProblem: {problem}"}],
        "ability": "math", "reward_model": {"ground_truth": truth, "style": "rule"},
        "extra_info": {"reward_method": "accuracy_reward"}}
       for source, problem, truth in [("APO_AIME24", "Find $x$ if $x+1=2$. ", "1"),
                                      ("APO_AMC23", "How many primes are below 10?", "4"),
                                      ("APO_AIME24", "Find $y$ if $2y=6$.", "3")] for _ in range(4)]
# The published files, by URL path on the test server.
PUBLISHED = {f"/datasets/test/gsm8k/resolve/{HUB_REV}/main/train.parquet": parquet(GSM8K),
             f"/datasets/test/math500/resolve/{HUB_REV}/test.jsonl": jsonl(MATH500),
             f"/authors/code/{GITHUB_REV}/{APO_PATH}": parquet(APO)}
# The mirror files, written out by hand from the rows above.
EXPECTED = {
    "gsm8k/train.jsonl": jsonl([{"id": "gsm8k-train-0", **GSM8K[0], "ground_truth": "1203"},
                                {"id": "gsm8k-train-1", **GSM8K[1], "ground_truth": "4"}]),
    "eval/math500.jsonl": jsonl([{"id": "test/algebra/1.json", "problem": "Compute $\\sqrt{16}$.",
                                  "ground_truth": "4", "subject": "Algebra", "level": 1}]),
    "eval/aime24.jsonl": jsonl([{"id": "aime24-0", "problem": "Find $x$ if $x+1=2$.", "ground_truth": "1"},
                                {"id": "aime24-1", "problem": "Find $y$ if $2y=6$.", "ground_truth": "3"}]),
    "eval/amc23.jsonl": jsonl([{"id": "amc23-0", "problem": "How many primes are below 10?",
                                "ground_truth": "4"}]),
}


def fake_manifest() -> dict[str, dict]:
    hub = {"kind": "hub_dataset", "revision": HUB_REV}
    apo = {"kind": "github_file", "repo": "authors/code", "revision": GITHUB_REV, "path": APO_PATH}
    sources = {"gsm8k/train.jsonl": ({**hub, "repo": "test/gsm8k", "path": "main/train.parquet"},
                                     {"kind": "gsm8k", "split": "train"}),
               "eval/math500.jsonl": ({**hub, "repo": "test/math500", "path": "test.jsonl"},
                                      {"kind": "math500"}),
               "eval/aime24.jsonl": (apo, {"kind": "verl_eval", "data_source": "APO_AIME24",
                                           "id_prefix": "aime24"}),
               "eval/amc23.jsonl": (apo, {"kind": "verl_eval", "data_source": "APO_AMC23",
                                          "id_prefix": "amc23"})}
    return {name: {"rows": EXPECTED[name].count(b"\n"), "sha256": sha256(EXPECTED[name]), "source": source,
                   "convert": convert} for name, (source, convert) in sources.items()}


class Publisher(BaseHTTPRequestHandler):
    """HEAD and GET of PUBLISHED, with Range; `drop` paths send half their body and close the connection
    once, after which every GET answers 503 while `broken`."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.serve(body=False)

    def do_GET(self) -> None:
        self.serve(body=True)

    def serve(self, body: bool) -> None:
        state, path = self.server.state, unquote(self.path)  # type: ignore[attr-defined]
        state["requests"].append((self.command, path, self.headers.get("Range")))
        data = state["files"].get(path)
        if data is None or (body and state["broken"]):
            self.send_response(404 if data is None else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        asked = self.headers["Range"] if body else None
        start = int(asked.split("=")[1].split("-")[0]) if asked else 0
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("ETag", f'"{sha256(data)}"')
        self.send_header("Accept-Ranges", "bytes")
        if path.startswith("/datasets/"):
            self.send_header("X-Repo-Commit", path.split("/")[5])
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        if path in state["drop"]:
            state["drop"].discard(path)
            state["broken"] = True
            self.wfile.write(data[start:start + (len(data) - start) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(data[start:])


@pytest.fixture
def server(monkeypatch):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Publisher)
    httpd.state = {"files": dict(PUBLISHED), "requests": [], "drop": set(), "broken": False}
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", base)
    monkeypatch.setenv("PARALLEL_R1_GITHUB_RAW", base)
    monkeypatch.setenv("PARALLEL_R1_GITHUB_LFS", f"{base}/media")
    yield httpd.state
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A project folder with no local mirror: neither $PARALLEL_R1_DATA nor ../shared/data."""
    monkeypatch.delenv("PARALLEL_R1_DATA", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    root = tmp_path / "project"
    root.mkdir()
    (root / "params.yaml").write_text("data: {mirror_dir: mirror}\n")
    return root


def written(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


def quiet(_line: str) -> None:
    pass


def test_a_download_is_converted_to_the_manifests_bytes_and_a_verified_mirror_needs_no_network(project,
                                                                                             server):
    mirror = project / "mirror"
    data_mirror.ensure(mirror, project, fake_manifest(), log=quiet)
    assert written(mirror) == EXPECTED                        # byte for byte; the download cache removed
    gets = [path for method, path, _range in server["requests"]
            if method == "GET" and not path.startswith("/api/")]   # the Hub client's telemetry, when on
    assert sorted(gets) == sorted(PUBLISHED)                 # the evaluation parquet once, for two files
    before = len(server["requests"])
    data_mirror.ensure(mirror, project, fake_manifest(), log=quiet)
    assert len(server["requests"]) == before                 # checked locally, nothing fetched


def test_a_conversion_whose_checksum_differs_is_refused_and_writes_nothing(project, server):
    manifest = {"eval/aime24.jsonl": dict(fake_manifest()["eval/aime24.jsonl"], sha256="0" * 64)}
    with pytest.raises(PipelineError) as refusal:
        data_mirror.ensure(project / "mirror", project, manifest, log=quiet)
    line = str(refusal.value)
    assert "\n" not in line
    assert line.startswith("eval/aime24.jsonl converted from http://127.0.0.1:")
    got = sha256(EXPECTED["eval/aime24.jsonl"])
    assert f"sha256 {got}, the data manifest (data_manifest.yaml) expects {'0' * 64}: refused" in line
    assert not list((project / "mirror").rglob("*.jsonl")) and not list((project / "mirror").rglob("*.tmp"))
    assert not list((project / "mirror").rglob("*.parquet"))   # nor its download: the next run fetches it


@pytest.mark.parametrize("name", ["eval/aime24.jsonl", "gsm8k/train.jsonl"])   # GitHub raw, then the Hub
def test_a_server_dropping_mid_file_leaves_no_mirror_file_and_a_rerun_completes(project, server, name):
    manifest = {name: fake_manifest()[name]}
    source = manifest[name]["source"]
    url_path = (f"/{source['repo']}/{source['revision']}/{source['path']}" if source["kind"] == "github_file"
                else f"/datasets/{source['repo']}/resolve/{source['revision']}/{source['path']}")
    server["drop"].add(url_path)
    with pytest.raises(PipelineError) as failure:
        data_mirror.ensure(project / "mirror", project, manifest, log=quiet)
    assert "\n" not in str(failure.value) and not server["drop"]   # it did drop, then answered 503
    assert str(failure.value).startswith(f"{name}: download of http://127.0.0.1:")
    assert not (project / "mirror" / name).exists()
    server["broken"] = False
    data_mirror.ensure(project / "mirror", project, manifest, log=quiet)
    assert (project / "mirror" / name).read_bytes() == EXPECTED[name]
    if source["kind"] == "github_file":   # the kept .part file resumed where the drop left it
        ranges = [rng for method, path, rng in server["requests"] if method == "GET" and path == url_path]
        assert ranges[0] is None and ranges[-1] == f"bytes={len(PUBLISHED[url_path]) // 2}-"


def test_a_git_lfs_pointer_is_followed_to_the_media_url(project, server):
    path = f"/authors/code/{GITHUB_REV}/{APO_PATH}"
    server["files"][f"/media{path}"] = server["files"][path]
    server["files"][path] = b"version https://git-lfs.github.com/spec/v1\noid sha256:x\nsize 1\n"
    manifest = {"eval/amc23.jsonl": fake_manifest()["eval/amc23.jsonl"]}
    data_mirror.ensure(project / "mirror", project, manifest, log=quiet)
    assert written(project / "mirror") == {"eval/amc23.jsonl": EXPECTED["eval/amc23.jsonl"]}


def test_with_no_server_the_cli_says_in_one_line_what_it_tried_and_how_to_point_at_a_mirror(project):
    with socket.socket() as probe:   # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "PYTHONPATH": str(REPO),
           "PARALLEL_R1_GITHUB_RAW": f"http://127.0.0.1:{port}"}
    env.pop("PARALLEL_R1_DATA", None)
    done = subprocess.run([sys.executable, "-m", "parallel_r1.mirror"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    gsm8k = data_mirror.load_manifest()["gsm8k/train.jsonl"]["source"]
    url = f"http://127.0.0.1:{port}/datasets/openai/gsm8k/resolve/{gsm8k['revision']}/{gsm8k['path']}"
    assert line.startswith(f"error: gsm8k/train.jsonl: cannot reach {url} (")
    assert "PARALLEL_R1_DATA" in line and "../shared/data" in line
    assert not (project / "mirror").exists() or not list((project / "mirror").rglob("*.jsonl"))


def test_a_source_with_no_pinned_revision_is_refused_naming_it(project, server):
    manifest = {"teacher.jsonl": {"rows": 1, "sha256": "0" * 64, "convert": None,
                                  "source": {"kind": "hub_dataset", "repo": "x/demos", "revision": None,
                                             "path": None}}}
    with pytest.raises(PipelineError, match=r"^teacher.jsonl: no pinned revision for x/demos in the data "
                                            r"manifest, so it cannot be downloaded; point PARALLEL_R1_DATA "
                                            r"at"):
        data_mirror.ensure(project / "mirror", project, manifest, log=quiet)
    assert server["requests"] == []


def local_mirror(folder: Path) -> Path:
    for name, data in EXPECTED.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def test_a_local_mirror_is_copied_and_verified_from_the_env_var_or_beside_the_project(project, tmp_path,
                                                                                       monkeypatch, server):
    shared = local_mirror(tmp_path / "shared" / "data")      # ../shared/data of the project
    data_mirror.ensure(project / "mirror", project, fake_manifest(), log=quiet)
    assert written(project / "mirror") == EXPECTED
    for name in EXPECTED:                                    # copies: DVC hashes what it reads
        copied = project / "mirror" / name
        assert not copied.is_symlink() and copied.stat().st_ino != (shared / name).stat().st_ino
    other = local_mirror(tmp_path / "lab")
    monkeypatch.setenv("PARALLEL_R1_DATA", str(other))
    (project / "mirror" / "eval" / "amc23.jsonl").unlink()
    lines: list[str] = []
    data_mirror.ensure(project / "mirror", project, fake_manifest(), log=lines.append)
    assert lines[0] == f"{project / 'mirror/eval/amc23.jsonl'}: copied from {other}, sha256 checked"
    assert server["requests"] == []                          # nothing downloaded


def test_a_corrupted_local_mirror_file_is_refused_naming_it_before_anything_is_written(project, tmp_path,
                                                                                     monkeypatch):
    lab = local_mirror(tmp_path / "lab")
    corrupted = lab / "eval" / "math500.jsonl"
    corrupted.write_bytes(corrupted.read_bytes().replace(b"Algebra", b"Algebre"))
    monkeypatch.setenv("PARALLEL_R1_DATA", str(lab))
    with pytest.raises(PipelineError) as refusal:
        data_mirror.ensure(project / "mirror", project, fake_manifest(), log=quiet)
    got = sha256(corrupted.read_bytes())
    assert str(refusal.value).startswith(f"{corrupted}: sha256 {got}, the data manifest")
    assert str(refusal.value).endswith(f"refused, nothing written to {project / 'mirror'}")
    assert not (project / "mirror").exists()
    monkeypatch.setenv("PARALLEL_R1_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(PipelineError, match=r"^\$PARALLEL_R1_DATA=.*nowhere: no such folder"):
        data_mirror.ensure(project / "mirror", project, fake_manifest(), log=quiet)


def test_a_private_clone_reads_its_worker_clones_mirror_linked_and_checked(project, tmp_path, monkeypatch):
    """What flows/remote.py::private_clone does for a sweep experiment or a fanned-out stage."""
    monkeypatch.setenv("PARALLEL_R1_DATA", str(local_mirror(tmp_path / "lab")))
    clone = project / ".dvc" / "tmp" / "pool" / "exp-1"
    clone.mkdir(parents=True)
    (clone / "params.yaml").write_text("data: {mirror_dir: mirror}\n")
    data_mirror.fill_clone(project, clone, fake_manifest(), log=quiet)   # the worker's mirror made first
    assert written(clone / "mirror") == written(project / "mirror") == EXPECTED
    for name in EXPECTED:
        assert (clone / "mirror" / name).stat().st_ino == (project / "mirror" / name).stat().st_ino
    outside = tmp_path / "clone-2"
    outside.mkdir()
    (outside / "params.yaml").write_text(yaml.safe_dump({"data": {"mirror_dir": str(tmp_path / "lab")}}))
    data_mirror.fill_clone(project, outside, fake_manifest(), log=quiet)  # a mirror outside: read in place
    assert written(outside) == {"params.yaml": (outside / "params.yaml").read_bytes()}


def test_the_committed_manifest_holds_the_reference_mirrors_hashes_and_rows(mirror):
    for name, entry in data_mirror.load_manifest().items():
        data = (mirror / name).read_bytes()
        assert (sha256(data), data.count(b"\n")) == (entry["sha256"], entry["rows"]), name


def test_every_mirror_file_a_stage_reads_is_in_the_manifest_with_a_source():
    from tests.test_data_mirror import mirror_deps

    manifest = data_mirror.load_manifest()
    declared = set().union(*mirror_deps().values())
    read = {source.mirror_file for source in (*SOURCES.values(), TEACHER_DEMOS)}
    assert declared <= read <= set(manifest)
    for name, entry in manifest.items():
        assert entry["source"]["kind"] in ("hub_dataset", "github_file"), name
        assert entry["source"]["revision"] is None or len(entry["source"]["revision"]) == 40, name
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    assert params["data"]["mirror_dir"] == data_mirror.DEFAULT_MIRROR
