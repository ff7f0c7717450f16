"""The docs cannot drift from the code: the blocks meant to run are run, and every public name is documented.

Convention for README.md and docs/*.md (docs/index.md explains it to writers):

- a fence opened with ```` ```python run ```` runs alone in a fresh Python process from the repository root
  and must exit 0; ```` ```bash run ```` runs under ``bash -euo pipefail`` with the virtual environment first
  on ``PATH``;
- ```` ```python run np=2 ```` runs as a real Horovod job of 2 ranks (``tests/multirank.py``, horovodrun with
  Gloo); such blocks are marked ``multirank`` (slow: keep them few);
- a ```` ```text output ```` fence right after a run block holds lines that must appear in its output, in
  that order (other lines may come between; trailing spaces and Horovod's ``[rank]<stdout>:`` prefixes are
  ignored; a line ``...`` is only a reminder that lines were left out);
- every other fence is an illustration and is not run.

Besides: the ``>>>`` examples in the core modules' docstrings run as doctests; every public name (each
module's ``__all__``) has a docstring with an ``Example``; and the API reference, built from those docstrings by
Sphinx (``make docs``) with warnings as errors, documents every public name.
"""
import functools
import json
import os
import re
import subprocess
import sys

import pytest

from multirank import QUIET_ENV, ROOT, run

DOC_FILES = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
FENCE = re.compile(r"^```(\S*)(.*)$")
RANK_PREFIX = re.compile(r"^\[\d+(,\d+)?\]<std(out|err)>:")


def _blocks(path):
    """``(line, language, options, code, expected_output)`` for every run block of one markdown file."""
    lines = open(os.path.join(ROOT, path)).read().splitlines()
    fences = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match and match.group(1):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            fences.append((i + 1, match.group(1), match.group(2).split(), "\n".join(lines[i + 1:end]) + "\n", end))
            i = end + 1
        else:
            i += 1
    found = []
    for k, (line, language, words, code, end) in enumerate(fences):
        if not words or words[0] != "run":
            continue
        if language not in ("python", "bash"):
            raise ValueError(f"{path}:{line}: run blocks must be python or bash, got {language!r}")
        options = dict(w.split("=", 1) for w in words[1:])
        expected = None
        after = fences[k + 1] if k + 1 < len(fences) else None
        if after and after[1] == "text" and after[2][:1] == ["output"] and \
                all(not lines[j].strip() for j in range(end + 1, after[0] - 1)):
            expected = after[3]
        found.append((line, language, options, code, expected))
    return found


def _params():
    params = []
    for path in DOC_FILES:
        for line, language, options, code, expected in _blocks(path):
            marks = [pytest.mark.multirank] if "np" in options else []
            params.append(pytest.param(path, language, options, code, expected, marks=marks,
                                       id=f"{path}:{line}" + (f"-np{options['np']}" if "np" in options else "")))
    return params


def _env():
    env = dict(os.environ)
    env.update(QUIET_ENV)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _check_output(output, expected):
    actual = [RANK_PREFIX.sub("", line).rstrip() for line in output.splitlines()]
    position = 0
    for want in expected.splitlines():
        want = want.rstrip()
        if not want or want == "...":
            continue
        try:
            position = actual.index(want, position) + 1
        except ValueError:
            pytest.fail(f"expected line not found (in order) in the block's output:\n  {want}\noutput:\n{output}")


def test_the_convention_is_parsed_as_documented(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nnot run\n```\n\n```python run\nprint(1)\n```\n\n```text output\n1\n```\n"
                    "```bash run\necho x\n```\n\n```python run np=2 timeout=60\npass\n```\n")
    blocks = _blocks(str(page))
    assert [(b[0], b[1], b[2], b[4]) for b in blocks] == [
        (5, "python", {}, "1\n"), (12, "bash", {}, None), (16, "python", {"np": "2", "timeout": "60"}, None)]
    _check_output("[0]<stdout>:a\n[0]<stdout>:1  \nb\n2\n", "1\n...\n2\n")
    with pytest.raises(pytest.fail.Exception):
        _check_output("2\n1\n", "1\n2\n")


def test_the_docs_have_run_blocks():
    assert len(_params()) >= 10, "the docs lost their runnable examples"


@pytest.mark.parametrize("path,language,options,code,expected", _params())
def test_doc_block_runs(path, language, options, code, expected, tmp_path):
    script = tmp_path / ("block.py" if language == "python" else "block.sh")
    script.write_text(code)
    timeout = int(options.get("timeout", 300))
    if "np" in options:
        output = run("gloo", int(options["np"]), str(script), timeout=timeout)
    else:
        argv = [sys.executable, str(script)] if language == "python" else ["bash", "-euo", "pipefail", str(script)]
        result = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"{path}: block exited {result.returncode}:\n{output}"
    if expected is not None:
        _check_output(output, expected)


@pytest.mark.multirank
def test_keras_synthetic_benchmark_example_runs(tmp_path):
    """examples/tf2_keras_synthetic_benchmark.py, named in the docs, with --dssync on 2 ranks."""
    out = tmp_path / "bench.jsonl"
    run("gloo", 2, f"{ROOT}/examples/tf2_keras_synthetic_benchmark.py", "--dssync", "--schedule", "butterfly",
        "--num-iters", "2", "--num-batches-per-iter", "3", "--json", out, timeout=300)
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["name"] == "dssync-butterfly" and result["ranks"] == 2 and result["step_ms"] > 0


DOCTEST_MODULES = ["hvd_dssync.schedules", "hvd_dssync.schedules.base", "hvd_dssync.schedules.shuffle",
                   "hvd_dssync.schedules.butterfly", "hvd_dssync.schedules.topology_aware",
                   "hvd_dssync.schedules.user", "hvd_dssync.topology", "hvd_dssync.policy", "hvd_dssync.plan",
                   "hvd_dssync.scope", "hvd_dssync.simulate.mixing", "hvd_dssync.simulate.links",
                   "hvd_dssync.simulate.table", "hvd_dssync.simulate.replay", "hvd_dssync.guards", "hvd_dssync.__main__",
                   "hvd_dssync.bench.scenarios", "hvd_dssync.bench.metric", "hvd_dssync.bench.report",
                   "hvd_dssync.bench.catalog", "hvd_dssync.adaptive.settings",
                   "hvd_dssync.adaptive.decisions", "hvd_dssync.adaptive.state", "hvd_dssync.adaptive.wire",
                   "hvd_dssync.sparse", "hvd_dssync.join", "hvd_dssync.config", "hvd_dssync.resolution", "hvd_dssync.differences",
                   "hvd_dssync.sensing.job", "hvd_dssync.sensing.rule", "hvd_dssync.sensing.probe",
                   "hvd_dssync.overlap", "hvd_dssync.fragments", "hvd_dssync.resense", "hvd_dssync.build",
                   "hvd_dssync.bench.arguments"]


@pytest.mark.parametrize("module", DOCTEST_MODULES)
def test_docstring_examples_run(module):
    code = ("import doctest, importlib, sys\n"
            f"m = importlib.import_module({module!r})\n"
            "r = doctest.testmod(m, optionflags=doctest.ELLIPSIS)\n"
            "sys.exit(1 if r.failed or not r.attempted else 0)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_suites_launcher_matrices_run_every_size_and_launcher():
    """tests/multirank.py's examples: ``make test`` runs each size and each launcher at least once."""
    import doctest

    import multirank
    result = doctest.testmod(multirank)
    assert result.attempted and not result.failed


PUBLIC_MODULES = ["hvd_dssync", "hvd_dssync.schedules", "hvd_dssync.topology", "hvd_dssync.policy",
                  "hvd_dssync.plan", "hvd_dssync.simulate", "hvd_dssync.torch", "hvd_dssync.keras",
                  "hvd_dssync.keras.callbacks", "hvd_dssync.keras.elastic", "hvd_dssync.watchdog",
                  "hvd_dssync.guards", "hvd_dssync.scope", "hvd_dssync.adaptive", "hvd_dssync.sparse",
                  "hvd_dssync.join", "hvd_dssync.sensing.job", "hvd_dssync.sensing.rule", "hvd_dssync.sensing.probe",
                  "hvd_dssync.overlap", "hvd_dssync.fragments", "hvd_dssync.config"]

# Public names whose docstring has no Example yet, in modules owned by others: reported, to be fixed there.
# A name that gains an Example must be removed from this list (the test says so).
KNOWN_WITHOUT_EXAMPLE = set()

_INVENTORY = r'''
import importlib, inspect, json, sys
module = importlib.import_module(sys.argv[1])
out = []
for name in module.__all__:
    obj = getattr(module, name)
    kind = ("module" if inspect.ismodule(obj) else "class" if inspect.isclass(obj)
            else "function" if callable(obj) else "constant")
    entry = {"name": name, "kind": kind, "doc": inspect.getdoc(obj) if kind != "constant" else None,
             "params": []}
    exception = inspect.isclass(obj) and issubclass(obj, BaseException)  # a builtin's signature: none to read
    if kind in ("class", "function") and not exception:
        for p in inspect.signature(obj).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                entry["params"].append([("*" if p.kind == p.VAR_POSITIONAL else "**") + p.name, None])
                continue
            # Horovod's ``op`` defaults are opaque ints (hvd.Average); the docs spell them by name.
            plain = p.default is not p.empty and p.name != "op" and (
                p.default is None or type(p.default) in (bool, int, float, str, tuple))
            entry["params"].append([p.name, repr(p.default) if plain else None])
    out.append(entry)
print("INVENTORY" + json.dumps(out))
'''


@functools.lru_cache(maxsize=None)
def _inventory(module):
    """Public names of ``module``, their kind, docstring and parameters, from a fresh process."""
    result = subprocess.run([sys.executable, "-c", _INVENTORY, module], cwd=ROOT, env=_env(), capture_output=True,
                            text=True, timeout=300)
    if result.returncode != 0:
        if "No module named" in result.stderr and module.split(".")[1:2] in (["torch"], ["keras"]):
            pytest.skip(f"{module} needs a framework that is not installed")
        raise AssertionError(result.stderr)
    line = next(l for l in result.stdout.splitlines() if l.startswith("INVENTORY"))
    return json.loads(line[len("INVENTORY"):])


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_has_a_docstring_with_an_example(module):
    missing, fixed = [], []
    for entry in _inventory(module):
        if entry["kind"] in ("constant", "module"):
            continue  # constants cannot carry a docstring (the reference lists them); modules: their names
        qualified = f"{module}.{entry['name']}"
        has = "Example" in (entry["doc"] or "")
        if not has and qualified not in KNOWN_WITHOUT_EXAMPLE:
            missing.append(qualified)
        if has and qualified in KNOWN_WITHOUT_EXAMPLE:
            fixed.append(qualified)
    assert not missing, f"public names without a docstring containing 'Example': {missing}"
    assert not fixed, f"these now have an Example: remove them from KNOWN_WITHOUT_EXAMPLE in {__file__}: {fixed}"


def test_sphinx_builds_the_reference_with_every_public_name(tmp_path):
    """``make docs``' build (Sphinx, warnings as errors) has a documented entry for every public name of the
    modules in docs/reference.rst."""
    out = tmp_path / "html"
    result = subprocess.run([os.path.join(os.path.dirname(sys.executable), "sphinx-build"), "-W", "--keep-going",
                             "-q", "-b", "html", os.path.join(ROOT, "docs"), str(out)], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    html = (out / "reference.html").read_text()
    documented = set(re.findall(r'^\.\. automodule:: (\S+)$', open(os.path.join(ROOT, "docs", "reference.rst")).read(),
                                re.M))
    missing = [f"{module}.{entry['name']}" for module in PUBLIC_MODULES if module in documented
               for entry in _inventory(module) if entry["kind"] not in ("module", "constant")
               and f'id="{module}.{entry["name"]}"' not in html]
    assert not missing, f"public names missing from the built reference: {missing}"
    undocumented = [m for m in PUBLIC_MODULES if m != "hvd_dssync" and m not in documented]
    assert not undocumented, f"public modules missing from docs/reference.rst: {undocumented}"
