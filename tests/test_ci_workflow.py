"""The CI workflow (.github/workflows/ci.yml) runs what the repository says CI runs: its cpu job
runs the command of .ci/run, every script a job calls is in the repository, and the GPU jobs run
ci/gpu.sh on 2 ranks and upload its output folder. The checks read the file as text (PyYAML
need not be installed); a parse with PyYAML, where it is, checks the same structure."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOW = os.path.join(ROOT, ".github", "workflows", "ci.yml")
JOBS = ("cpu", "cpu-numpy-latest", "gpu-nvidia", "gpu-amd")
GPU_JOBS = {"gpu-nvidia": "nvidia", "gpu-amd": "amd"}
NO_MULTICAST = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
#: scripts that land with a change of their own: skipped, not failed, on a checkout without them
ADDED_SEPARATELY = {"ci/test_numpy_latest.sh"}


def _read(*parts) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def jobs(text: str) -> dict:
    """Job name -> the lines of its block (comments dropped), read from the indentation: the
    jobs are the keys indented once under the top-level ``jobs:``."""
    out, current, inside = {}, None, False
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            inside, current = line.rstrip() == "jobs:", None
            continue
        m = re.match(r"^  ([\w-]+):\s*$", line)
        if inside and m:
            current = out[m.group(1)] = []
        elif inside and current is not None:
            current.append(line)
    return out


def run_commands(block: list) -> list:
    """The shell commands of a job's ``run:`` steps, a block scalar (``run: |``) joined by
    newlines."""
    out, i = [], 0
    while i < len(block):
        m = re.match(r"^(\s*(?:- )?)run:\s*(.*)$", block[i])
        i += 1
        if not m:
            continue
        if m.group(2) not in ("|", ">"):
            out.append(m.group(2).strip())
            continue
        key_column = len(m.group(1))  # the body is indented past the key
        body = []
        while i < len(block) and len(block[i]) - len(block[i].lstrip()) > key_column:
            body.append(block[i].strip())
            i += 1
        out.append("\n".join(body))
    return out


def scripts_called(command: str) -> list:
    """Repository paths of the scripts a command runs (``bash ci/x.sh``, ``python y.py``)."""
    return re.findall(r"(?:^|[\s;&|(])(?:bash|sh|python3?)\s+([\w./-]+\.(?:sh|py))\b", command)


def _value(block: list, key: str) -> list:
    return [m.group(1).strip() for m in (re.match(rf"^\s*(?:- )?{key}:\s*(.*)$", line)
                                         for line in block) if m]


WORKFLOW_JOBS = jobs(_read(".github", "workflows", "ci.yml"))


def test_the_jobs_are_there():
    assert set(JOBS) <= set(WORKFLOW_JOBS), sorted(WORKFLOW_JOBS)


def test_cpu_job_runs_the_command_of_ci_run():
    """.ci/run ends in ``exec bash ci/test.sh``; the cpu job runs that command and nothing else."""
    lines = [line.strip() for line in _read(".ci", "run").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines[-1].startswith("exec "), lines[-1]
    command = lines[-1][len("exec "):]
    assert command == "bash ci/test.sh"
    cpu = WORKFLOW_JOBS["cpu"]
    assert run_commands(cpu) == [command]
    assert _value(cpu, "runs-on") == ["ubuntu-latest"]
    assert any("actions/setup-python@" in u for u in _value(cpu, "uses"))
    assert "3.11" in " ".join(_value(cpu, "python")), "the matrix lacks Python 3.11"


def test_numpy_latest_job():
    assert run_commands(WORKFLOW_JOBS["cpu-numpy-latest"]) == ["bash ci/test_numpy_latest.sh"]


@pytest.mark.parametrize("script", sorted({s for block in WORKFLOW_JOBS.values()
                                           for c in run_commands(block)
                                           for s in scripts_called(c)}))
def test_every_script_a_job_calls_exists(script):
    path = os.path.join(ROOT, script)
    if script in ADDED_SEPARATELY and not os.path.exists(path):
        pytest.skip(f"{script} is not in this checkout")
    assert os.path.isfile(path), f"the workflow calls {script}, which the repository lacks"


def test_gpu_script_takes_outdir_and_ranks():
    text = _read("ci", "gpu.sh")
    assert re.search(r"^out=\$\{1:", text, re.M) and re.search(r"^nproc=\$\{2:", text, re.M)


@pytest.mark.parametrize("job", sorted(GPU_JOBS))
def test_gpu_job_runs_two_ranks_and_uploads(job):
    block = WORKFLOW_JOBS[job]
    labels = _value(block, "runs-on")
    assert labels and "self-hosted" in labels[0] and GPU_JOBS[job] in labels[0], labels
    calls = [m for c in run_commands(block)
             for m in re.finditer(r"bash ci/gpu\.sh\s+(\S+)\s+(\d+)", c)]
    assert len(calls) == 1, run_commands(block)
    outdir, ranks = calls[0].group(1).strip("\"'"), calls[0].group(2)
    assert ranks == "2"
    # the upload takes the folder ci/gpu.sh wrote, even when the script failed
    text = "\n".join(block)
    assert "actions/upload-artifact@" in text
    assert "if: always()" in text
    paths = _value(block, "path")
    assert paths and paths[-1] == outdir.replace("$RUNNER_TEMP", "${{ runner.temp }}"), \
        (paths, outdir)
    for var in NO_MULTICAST:
        assert re.search(rf"\b{var}\b", text), f"{job} does not set {var}"


def test_the_parsed_workflow_agrees():
    yaml = pytest.importorskip("yaml")
    with open(WORKFLOW, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    assert True in doc or "on" in doc  # YAML 1.1 reads the key `on` as true
    assert set(doc["jobs"]) == set(WORKFLOW_JOBS)
    for name, job in doc["jobs"].items():
        runs = [s["run"].strip() for s in job["steps"] if "run" in s]
        assert runs == run_commands(WORKFLOW_JOBS[name]), name
    assert "3.11" in [str(v) for v in doc["jobs"]["cpu"]["strategy"]["matrix"]["python"]]
    for name in GPU_JOBS:
        job = doc["jobs"][name]
        assert job["runs-on"][0] == "self-hosted"
        up = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@")]
        assert len(up) == 1 and up[0]["if"] == "always()", up
        assert {k: str(v) for k, v in job["env"].items() if k in NO_MULTICAST} == \
            {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.parametrize("gpu,nproc,kind", [
    ("NVIDIA H200", 4, "nvidia-h200-x4"), ("NVIDIA H200", 1, "nvidia-h200"),
    ("NVIDIA H100 80GB HBM3", 4, "nvidia-h100-x4"), ("NVIDIA H100 80GB HBM3", 1, "nvidia-h100-x1"),
    (None, 2, "unknown-gpu-x2")])
def test_device_kind_names_the_machine(tmp_path, gpu, nproc, kind):
    """The results file of a GPU run is named by the GPUs it ran on (ci/device_kind.sh), so an
    H100 machine's rows never land in an H200 file; the scripts default to it."""
    import subprocess

    if gpu is not None:  # a stand-in nvidia-smi that answers the name query
        smi = tmp_path / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho '{gpu}'\necho '{gpu}'\n")
        smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    got = subprocess.run(["bash", os.path.join(ROOT, "ci", "device_kind.sh"), str(nproc)],
                         capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert got == kind
    for script in ("gpu.sh", "scaleup.sh", "compare_commits.sh"):
        assert "device_kind.sh" in _read("ci", script), script
