"""The README and docs/*.md say what the code does: their runnable samples run as written (on
CPU-emulated ranks, sizes shrunk), and the names, paths and variables they cite exist."""
import glob
import os
import re

import pytest

import portable_overlap as po

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _text(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def _python_block(rel: str, after: str) -> str:
    """The first ```python block of ``rel`` that follows the line ``after``."""
    text = _text(rel)
    start = text.index(after)
    m = re.compile(r"^```python\n(.*?)^```", re.S | re.M).search(text, start)
    assert m, f"{rel}: no python block after {after!r}"
    return m.group(1)


def _shrunk(code: str, old: str, new: str) -> str:
    assert old in code, f"the sample no longer has {old!r}: update this test with it"
    return code.replace(old, new)


# --- samples, run on 2 emulated ranks --------------------------------------------------------

def _run_quickstart(world, code):
    import torch.distributed as dist

    ns: dict = {}
    exec(compile(code, "README.md:Quickstart", "exec"), ns)
    a, b, y, M = ns["a"], ns["b"], ns["y"], ns["M"]
    full = a.float() @ b.float()
    dist.all_reduce(full, group=world.group)
    r, w = world.rank, world.world_size
    want = full[r * M // w:(r + 1) * M // w]
    try:  # README, "When something goes wrong": a call on a closed context raises
        ns["po"].matmul_reduce_scatter(a, b, ns["ctx"])
        closed = False
    except ns["po"].ContextClosedError:
        closed = True
    return tuple(y.shape), (y.float() - want).abs().max().item(), closed


def test_readme_quickstart_runs_on_two_ranks(world2):
    code = _python_block("README.md", "## Quickstart")
    code = _shrunk(code, "M, N, K = 8192, 8192, 4096", "M, N, K = 64, 32, 16")
    for shape, err, closed in world2.run(_run_quickstart, code):
        assert shape == (32, 32) and closed
        assert err < 0.25, err  # bf16 operands, a sum of 2 x 16 products


def _run_torch_op_form(world, call):
    import torch

    M, N, K = 64, 32, 16
    a, b = torch.randn(M, K), torch.randn(K, N)
    with po.MatmulReduceScatter(world, max_m=M, max_n=N) as ctx:  # README: "or use `with ctx:`"
        y = eval(call, {"torch": torch, "a": a, "b": b, "ctx": ctx})
        return torch.equal(y, po.matmul_reduce_scatter(a, b, ctx))


def test_readme_torch_op_form_runs_on_two_ranks(world2):
    call = "torch.ops.portable_overlap.matmul_reduce_scatter(a, b, ctx.handle, bias=None)"
    assert call in _text("README.md").replace("\n", " ")
    assert world2.run(_run_torch_op_form, call) == [True, True]


def _run_language_sample(world, code, folder):
    import runpy

    import torch
    import torch.distributed as dist

    path = os.path.join(folder, f"language_sample_{world.rank}.py")  # triton.jit reads the
    with open(path, "w") as f:                                       # kernel's source file
        f.write(code)
    ns = runpy.run_path(path)
    xs = [torch.empty_like(ns["x"]) for _ in range(world.world_size)]
    dist.all_gather(xs, ns["x"], group=world.group)
    prev = (world.rank - 1) % world.world_size
    ok = torch.equal(ns["inbox"], xs[prev])
    ns["ws"].close()
    return ok


def test_language_shift_kernel_runs_on_two_ranks(world2, tmp_path):
    code = _python_block("docs/language.md", "# Writing your own fused kernels")
    assert world2.run(_run_language_sample, code, str(tmp_path)) == [True, True]


# --- names, paths and variables the docs cite -----------------------------------------------

def test_every_po_name_the_docs_use_is_exported():
    missing = {}
    for rel in DOCS:
        for name in re.findall(r"\bpo\.([A-Za-z_]\w*)", _text(rel)):
            if not hasattr(po, name):
                missing.setdefault(name, rel)
    assert not missing, f"po.<name> a doc uses that portable_overlap lacks: {missing}"


def test_every_context_and_op_in_the_readme_table_exists():
    table = [ln for ln in _text("README.md").splitlines() if ln.startswith("| `")]
    assert len(table) == 9, table
    for row in table:
        cells = row.split("|")
        op = re.match(r" `(\w+)`", cells[1]).group(1)
        assert callable(getattr(po, op)), op
        ctx = re.search(r"\(`(\w+)`\)", cells[1])
        if ctx:
            transports = re.findall(r"`(\w+)`", cells[3])
            assert set(transports) <= set(getattr(po, ctx.group(1)).TRANSPORTS), row
            assert op in po.OPS


_PATH = re.compile(r"`((?:\.\./)?(?:[\w.-]+/)+[\w.-]+\.(?:py|sh|md|jsonl|json|toml|png|txt))"
                   r"(?:[: ][^`]*)?`")


def test_every_path_the_docs_name_exists():
    """A backquoted path with a folder: from the repository root, the doc's folder or the
    package (``ops/sequential.py``); ``../shared/...`` is the project's, outside the repo."""
    missing = []
    for rel in DOCS:
        here = os.path.dirname(rel)
        for n, line in enumerate(_text(rel).splitlines(), 1):
            for path in _PATH.findall(line):
                if path.startswith("../shared/"):
                    continue
                places = [path, os.path.join(here, path), os.path.join("portable_overlap", path),
                          os.path.join("portable_overlap", "ops", path)]
                if not any(os.path.exists(os.path.join(ROOT, p)) for p in places):
                    missing.append(f"{rel}:{n}: {path}")
    assert not missing, "\n".join(missing)


def test_every_env_override_the_docs_name_is_read_by_the_code():
    code = ""
    for path in glob.glob(os.path.join(ROOT, "portable_overlap", "**", "*.py"), recursive=True):
        with open(path) as f:
            code += f.read()
    for rel in DOCS:
        for var in set(re.findall(r"\bPORTABLE_OVERLAP_[A-Z_]*[A-Z]\b", _text(rel))):
            assert f'"{var}"' in code, f"{rel} names {var}, which the package never reads"


@pytest.mark.parametrize("script", ["ci/demo.sh", "ci/test.sh", "ci/test_numpy_latest.sh",
                                    "ci/gpu.sh", ".ci/run"])
def test_the_readme_scripts_exist(script):
    assert f"{script}" in _text("README.md")
    assert os.path.isfile(os.path.join(ROOT, script))


def test_the_readme_benchmark_options_exist():
    from benchmarks.cli import BenchParser

    flags = set()
    for action in BenchParser("x", dims=("m",), shapes=[(1,)])._actions:
        flags.update(action.option_strings)
    text = _text("README.md")
    start = text.index("Every benchmark (`benchmarks/bench_*.py`")
    named = set(re.findall(r"`(--[\w-]+)", text[start:text.index("![", start)]))
    assert named and named <= flags, named - flags


def _run_language_ring(world, code, folder):
    import runpy

    import torch
    import torch.distributed as dist

    head, tail = code.split("\nws = Workspace(", 1)
    assert "shmem=True" in tail and "\n...\n" in tail, tail
    n = 1000  # the elided set-up: one buffer each, the ranks' flags, the data to pass on
    setup = (f"world, nbytes, n = World.from_env(), 1 << 16, {n}\n"
             "ws = Workspace(world, nbytes, name=\"ring\", shmem=False)\n"
             "inbox = ws.tensor((n,), torch.float32)\n"
             "ready = ws.flags((world.world_size,), \"ready\")\n"
             "x = torch.randn(n, device=world.device)\n")
    launch = tail.split("\n...\n", 1)[1]
    src = ("import torch, triton, triton.language as tl\n"
           "import portable_overlap.language as pol\n"
           "from portable_overlap import World, Workspace\n" + head + "\n" + setup + launch
           + "ws.synchronize()\n")
    path = os.path.join(folder, f"language_ring_{world.rank}.py")
    with open(path, "w") as f:
        f.write(src)
    ns = runpy.run_path(path)
    xs = [torch.empty_like(ns["x"]) for _ in range(world.world_size)]
    dist.all_gather(xs, ns["x"], group=world.group)
    ok = torch.equal(ns["inbox"], xs[(world.rank - 1) % world.world_size])
    ns["ws"].close()
    return ok


def test_language_ring_kernel_runs_zero_copy_on_two_ranks(world2, tmp_path):
    """The constexpr-branch sample, its elided set-up filled in, on a zero-copy workspace
    (``VIA_SHMEM=ws.shmem`` is False: the SHMEM branch is not compiled)."""
    code = _python_block("docs/language.md", "One kernel serves both kinds of workspace")
    assert world2.run(_run_language_ring, code, str(tmp_path)) == [True, True]


# --- launch-script variables, script options, links, torch ops, transports ---------------------

def _launch_code() -> str:
    """What reads the ``PO_*`` switches: the CI scripts and workflow, the GPU checks, the
    benchmarks, the tests and the examples."""
    paths = (glob.glob(os.path.join(ROOT, "ci", "*.sh"))
             + glob.glob(os.path.join(ROOT, ".github", "workflows", "*.yml"))
             + [os.path.join(ROOT, ".ci", "run")]
             + [p for d in ("benchmarks", "tests", "examples")
                for p in glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)])
    return "".join(_text(os.path.relpath(p, ROOT)) for p in paths if os.path.isfile(p))


def test_every_po_switch_the_docs_name_is_read_by_a_script():
    code = _launch_code()
    missing = [f"{rel}: {var}" for rel in DOCS
               for var in sorted(set(re.findall(r"\bPO_[A-Z0-9_]*[A-Z0-9]\b", _text(rel))))
               if not re.search(rf"\b{var}\b", code)]
    assert not missing, f"PO_* switches no script reads: {missing}"


# a script a command line of the docs runs: ``-m benchmarks.bench_x`` or a path to a .py / .sh
_SCRIPT = re.compile(r"-m (benchmarks\.\w+|portable_overlap)\b"
                     r"|\b((?:benchmarks|tests/gpu|examples/\w+|ci|docs/tutorials)/\w+\.(?:py|sh))")
#: scripts that hand their options to another program (ci/test.sh: pytest)
_PASS_THROUGH = {"ci/test.sh"}


def test_every_option_the_docs_give_a_script_is_one_it_takes():
    """``--name`` after a script in one backquoted span or code line: the script defines it
    (the benchmarks: or the shared ``BenchParser`` of ``benchmarks/cli.py``)."""
    shared = _text("benchmarks/cli.py")
    wrong = []
    for rel in DOCS:
        text = _text(rel).replace("\\\n", " ")  # a shell line continued
        for n, line in enumerate(text.splitlines(), 1):
            for span in line.split("`"):
                m = _SCRIPT.search(span)
                if not m:
                    continue
                path = (m.group(2) or ("portable_overlap/__main__.py" if m.group(1) ==
                                       "portable_overlap" else m.group(1).replace(".", "/")
                                       + ".py"))
                if path in _PASS_THROUGH:
                    continue
                assert os.path.isfile(os.path.join(ROOT, path)), f"{rel}:{n}: no {path}"
                src = _text(path) + (shared if path.startswith("benchmarks/") else "")
                for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", span[m.end():]):
                    if f'"{flag}"' not in src and f"'{flag}'" not in src:
                        wrong.append(f"{rel}:{n}: {path} takes no {flag}")
    assert not wrong, "\n".join(wrong)


def _anchors(rel: str) -> set:
    """GitHub's anchors of ``rel``'s headings: lower case, punctuation dropped, spaces to '-'."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+ (.*)$", _text(rel), re.M)}


def test_every_relative_link_resolves():
    broken = []
    for rel in DOCS:
        for n, line in enumerate(_text(rel).splitlines(), 1):
            prose = re.sub(r"`[^`]*`", "", line)  # not code: kernel[grid](...)
            for target in re.findall(r"\]\(([^)\s]+)\)", prose):
                if re.match(r"[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(rel), path)) if path else rel
                if not os.path.exists(os.path.join(ROOT, dest)):
                    broken.append(f"{rel}:{n}: {target} (no {dest})")
                elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                    broken.append(f"{rel}:{n}: {target} (no heading #{anchor} in {dest})")
    assert not broken, "\n".join(broken)


def test_every_torch_op_the_docs_name_is_defined():
    from portable_overlap.ops.registry import PARTS

    for rel in DOCS:
        for name in re.findall(r"torch\.ops\.portable_overlap\.(\w+)", _text(rel)):
            assert name in po.SPECS or name in PARTS, f"{rel}: torch.ops.portable_overlap.{name}"


def test_every_transport_the_docs_give_a_context_is_one_it_has():
    """``Context(..., transport="x")`` in the docs: ``x`` is one of the context's transports
    (or ``"auto"``)."""
    contexts = {spec.context.__name__: spec.context for spec in po.SPECS.values()}
    wrong = []
    for rel in DOCS:
        text = _text(rel)
        for ctx, transport in re.findall(r"\b(\w+)\([^()`]*?transport=\"(\w+)\"", text):
            if ctx in contexts and transport not in (*contexts[ctx].TRANSPORTS, "auto"):
                wrong.append(f"{rel}: {ctx}(transport={transport!r})")
    assert not wrong, wrong
