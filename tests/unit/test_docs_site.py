"""The documentation site: its generated references are what the code produces now, it builds with
`mkdocs build --strict` (a broken link, a missing anchor or a page left out of the nav fails), the
supported-models page is the one place that lists the architectures, and every flag the README and
the site name exists in the parser of the command it is given to."""
from __future__ import annotations

import argparse
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_serve import docs_gen
from moe_serve.models.registry import supported_architectures

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MKDOCS = [sys.executable, "-m", "mkdocs"]


def _prose_pages() -> list[Path]:
    """README.md and every hand-written page of the site (the references are generated)."""
    return [ROOT / "README.md"] + sorted(p for p in DOCS.rglob("*.md") if p.parent.name != "reference")


@pytest.fixture(scope="module")
def pages():
    """What the generators produce now (about 6 s: the models are built on the meta device)."""
    return docs_gen.render_all()


def test_generated_references_match_the_code(pages):
    stale = docs_gen.stale_pages(pages)
    assert not stale, (f"{', '.join(stale)} differ from what the code produces now; regenerate them with "
                       f"`python -m moe_serve.docs_gen` and commit the result")


def test_references_cover_the_code(pages):
    """Spot checks that the generators read the live objects: every subcommand, every metric the
    server renders, every architecture and its cache kinds, every request body."""
    cli, metrics = pages["docs/reference/cli.md"], pages["docs/reference/metrics.md"]
    models, http = pages["docs/reference/models.md"], pages["docs/reference/http.md"]
    for cmd in ("serve", "router", "env", "launch", "default-model", "bench serve", "bench throughput",
                "bench latency", "placement tune", "placement report"):
        assert f"## `moe-serve {cmd}`" in cli
    assert "## `python -m launcher serve`" in cli and "`--enable-elastic-ep`" in cli and "`--dist-interface NAME`" in cli
    from moe_serve.metrics import EngineMetrics
    from moe_serve.protocol import EngineStats, SpecDecodeStats

    rendered = EngineMetrics().render("m", EngineStats(spec_decode=SpecDecodeStats(accepted_per_pos=[0])))
    for name in re.findall(r"^# HELP (\S+) ", rendered, re.M):
        assert f"| `{name}` |" in metrics, name
    assert "`moe_serve_router:worker_up`" in metrics
    for arch in supported_architectures():
        assert f"| `{arch}` |" in models, arch
    rows = {line.split("|")[1].strip(" `"): line.split("|")[4].strip() for line in models.splitlines()
            if line.startswith("| `")}
    assert rows["GptOssForCausalLM"] == "full, sliding" and rows["Llama4ForCausalLM"] == "full, chunked"
    assert rows["Qwen3NextForCausalLM"] == "full, state" and rows["MixtralForCausalLM"] == "full"
    assert rows["DeepseekV32ForCausalLM"] == "full (MLA latent, indexer keys)"
    for body in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest"):
        assert f"### {body}" in http
    assert "| `response_format` |" in http and "`/v1/messages/count_tokens`" in http


def test_model_notes_follow_the_registry(monkeypatch):
    """An architecture added to the registry without a row (or a row for one no longer served)
    stops the generator, naming it."""
    from moe_serve.models import registry

    monkeypatch.setitem(registry._MODELS, "NewMoeForCausalLM", ("moe_serve.models.mixtral", "MixtralForCausalLM"))
    with pytest.raises(ValueError, match="missing \\['NewMoeForCausalLM'\\]"):
        docs_gen.model_rows()


def _build(root: Path, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(MKDOCS + ["build", "--strict", "--site-dir", str(out)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_site_builds_strict(tmp_path):
    r = _build(ROOT, tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    for page in ("index.html", "quickstart/index.html", "reference/models/index.html", "reference/cli/index.html",
                 "guides/multi-node/index.html", "deploy/index.html", "architecture/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_a_broken_link_fails_the_build(tmp_path):
    """The strictness is real: a link to a missing anchor fails, and so does a page not in the nav."""
    for case in ("anchor", "orphan"):
        root = tmp_path / case
        root.mkdir()
        shutil.copy(ROOT / "mkdocs.yml", root)
        shutil.copytree(DOCS, root / "docs")
        if case == "anchor":
            with open(root / "docs" / "index.md", "a") as f:
                f.write("\n[gone](guides/serving.md#no-such-section)\n")
        else:
            (root / "docs" / "orphan.md").write_text("# Not in the nav\n")
        r = _build(root, root / "site")
        assert r.returncode != 0, case
        assert ("no-such-section" if case == "anchor" else "orphan.md") in r.stdout + r.stderr


def test_supported_models_page_is_the_one_list():
    """No other page (and not the README) names the architectures: they live in the generated table."""
    archs = supported_architectures()
    for page in _prose_pages():
        text = page.read_text()
        named = [a for a in archs if re.search(rf"\b{a}\b", text)]
        assert not named, f"{page.relative_to(ROOT)} names {named}: link to docs/reference/models.md instead"


def test_readme_is_a_front_page_whose_links_resolve():
    """At most 150 lines, and every relative link in it names a file here (and, into the site, a
    heading of that page)."""
    from markdown.extensions.toc import slugify

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert len(links) >= 15
    for target, anchor in links:
        if target.startswith("http"):
            continue
        assert (ROOT / target).is_file(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / target).read_text(), re.M)
            assert anchor in {slugify(h, "-") for h in headings}, f"{target}#{anchor}"


# --- flags ----------------------------------------------------------------------------------------

class _Captured(Exception):
    pass


def _script_parser(path: Path) -> argparse.ArgumentParser:
    """The parser a script builds when run as a program, taken at its parse_args call."""
    real = argparse.ArgumentParser.parse_args

    def grab(self, *a, **k):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = grab
    argv, path_before, modules_before = sys.argv, list(sys.path), set(sys.modules)
    sys.argv = [str(path)]
    try:
        if path.suffix == ".py":
            runpy.run_path(str(path), run_name="__main__")
        else:
            runpy.run_module(str(path), run_name="__main__", alter_sys=False)
    except _Captured as c:
        return c.args[0]
    finally:
        argparse.ArgumentParser.parse_args = real
        sys.argv = argv
        # A script that put its own folder first on sys.path (bench/) leaves it as it was: its
        # modules would shadow packages later tests import (bench/kernels.py for `kernels`).
        sys.path[:] = path_before
        for name in set(sys.modules) - modules_before:
            if str(ROOT / "bench") in str(getattr(sys.modules[name], "__file__", None) or ""):
                del sys.modules[name]
    raise AssertionError(f"{path} never parsed its arguments")


def _torchrun_flags() -> set[str]:
    from torch.distributed.run import get_args_parser

    return docs_gen.parser_flags(get_args_parser())


# Commands of other tools, whose flags are theirs.
_FOREIGN = {"pip", "docker", "kubectl", "curl", "git", "apt-get", "export", "cd", "bash"}


def _commands(text: str) -> list[str]:
    """The shell commands of a page's fenced bash blocks (continuations joined, comments dropped)."""
    out = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                out.extend(part.strip() for part in re.split(r"&&|;", line) if part.strip())
    return out


class FlagChecker:
    def __init__(self):
        self.parsers = docs_gen.cli_parsers()
        self.torchrun = _torchrun_flags()
        self.scripts: dict[str, set[str]] = {}

    def script_flags(self, script: str) -> set[str]:
        if script not in self.scripts:
            path = ROOT / script if script.endswith(".py") else Path(script)
            self.scripts[script] = docs_gen.parser_flags(_script_parser(path) if script.endswith(".py")
                                                         else _module_parser(script))
        return self.scripts[script]

    def all_flags(self) -> set[str]:
        flags = set(self.torchrun)
        for p in self.parsers.values():
            flags |= docs_gen.parser_flags(p)
        for s in self.scripts.values():
            flags |= s
        return flags

    def moe_serve(self, words: list[str]) -> list[str]:
        """Unknown flags of one `moe-serve ...` command line."""
        cmd, rest = "moe-serve", list(words)
        while rest and any(k == f"{cmd} {rest[0]}" or k.startswith(f"{cmd} {rest[0]} ") for k in self.parsers):
            cmd, rest = f"{cmd} {rest[0]}", rest[1:]
        assert cmd in self.parsers, f"`{' '.join(['moe-serve', *words])}`: no such subcommand"
        if cmd == "moe-serve launch":
            head, tail = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
            return self._unknown(head, self.parsers[cmd]) + self._unknown(tail, self.parsers["python -m launcher serve"])
        return self._unknown(rest, self.parsers[cmd])

    def launcher(self, words: list[str]) -> list[str]:
        """`torchrun [torchrun flags] -m launcher serve [flags]`."""
        i = words.index("-m")
        assert words[i + 1:i + 3] == ["launcher", "serve"], words
        torchrun = [w for w in words[:i] if w.startswith("--") and w.split("=")[0] not in self.torchrun]
        return torchrun + self._unknown(words[i + 3:], self.parsers["python -m launcher serve"])

    @staticmethod
    def _unknown(words: list[str], parser: argparse.ArgumentParser) -> list[str]:
        known = docs_gen.parser_flags(parser)
        return [w for w in words if w.startswith("--") and w != "--" and w.split("=")[0] not in known]


def _module_parser(module: str) -> argparse.ArgumentParser:
    import importlib

    mod = importlib.import_module(module)
    real = argparse.ArgumentParser.parse_args

    def grab(self, *a, **k):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = grab
    try:
        mod.main([])
    except _Captured as c:
        return c.args[0]
    finally:
        argparse.ArgumentParser.parse_args = real
    raise AssertionError(f"{module}.main never parsed its arguments")


def check_page_flags(text: str, checker: FlagChecker) -> list[tuple[str, str]]:
    """(flag, where) for each unknown flag of one page: each command's flags against its own parser,
    then every other `--flag` in code against the flags of every command the docs run."""
    return command_flag_problems(text, checker) + prose_flag_problems(text, checker)


def command_flag_problems(text: str, checker: FlagChecker) -> list[tuple[str, str]]:
    """Each command of the page's shell blocks, its flags against its own parser (a script's
    parser is captured on first use, and joins the flags prose may name)."""
    problems = []
    for line in _commands(text):
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        words = [w for w in words if not w.startswith("[") and not w.endswith("]")]  # [OPTIONAL] placeholders
        if not words or words[0].rsplit("/", 1)[-1] in _FOREIGN:
            continue
        prog = words[0].rsplit("/", 1)[-1]
        if prog == "moe-serve":
            bad = checker.moe_serve(words[1:])
        elif prog == "torchrun" or words[1:4] == ["-m", "torch.distributed.run"]:
            bad = checker.launcher(words[1:])
        elif prog.startswith("python") and len(words) > 1 and words[1].endswith(".py"):
            known = checker.script_flags(words[1])
            bad = [w for w in words[2:] if w.startswith("--") and w.split("=")[0] not in known]
        elif prog.startswith("python") and words[1:2] == ["-m"] and words[2].startswith("moe_serve."):
            known = checker.script_flags(words[2])
            bad = [w for w in words[3:] if w.startswith("--") and w.split("=")[0] not in known]
        else:
            continue
        problems += [(w, line) for w in bad]
    return problems


def prose_flag_problems(text: str, checker: FlagChecker) -> list[tuple[str, str]]:
    """Flags in prose, inline code and comments: each must belong to one of the commands the docs run."""
    problems = []
    known = checker.all_flags()
    code = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    code += [c for b in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S) for c in re.findall(r"#.*", b)]
    for span in code:
        if span.split() and span.split()[0].rsplit("/", 1)[-1] in _FOREIGN:
            continue
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span):
            if flag not in known:
                problems.append((flag, span.strip()))
    return problems


@pytest.fixture(scope="module")
def checker():
    return FlagChecker()


def test_every_flag_in_the_readme_and_the_site_exists(checker):
    problems = {}
    for page in _prose_pages():  # every command first: the scripts they run join the known flags
        problems[str(page.relative_to(ROOT))] = command_flag_problems(page.read_text(), checker)
    for page in _prose_pages():
        problems[str(page.relative_to(ROOT))] += prose_flag_problems(page.read_text(), checker)
    problems = {page: bad for page, bad in problems.items() if bad}
    assert not problems, problems


def test_the_flag_check_catches_a_wrong_flag(checker):
    page = ("```bash\n.venv/bin/moe-serve serve --model DIR --max-model-length 4096\n"
            "moe-serve launch --nproc-per-node 8 --dist-interface eth0 -- --model DIR\n"
            "torchrun --nproc-per-node 2 -m launcher serve --model DIR --elastic-joins 1\n"
            ".venv/bin/python bench/placement.py --held-out && .venv/bin/python bench/eplb.py --held-out\n```\n"
            "Set `--no-such-flag` in prose.\n")
    # --dist-interface exists, but belongs after `--` (a flag of the ranks, not of `moe-serve launch`).
    # bench/placement.py has --held-out, bench/eplb.py does not.
    assert sorted(flag for flag, _ in check_page_flags(page, checker)) == sorted([
        "--max-model-length", "--dist-interface", "--elastic-joins", "--held-out", "--no-such-flag"])


# --- other names the prose gives ------------------------------------------------------------------

def test_every_metric_the_prose_names_is_exported(pages):
    metrics = pages["docs/reference/metrics.md"]
    exported = set(re.findall(r"\| `(moe_serve(?:_router)?:[a-z0-9_]+)` \|", metrics))
    problems = []
    for page in _prose_pages():
        for name in re.findall(r"moe_serve(?:_router)?:[a-z0-9_]*[a-z0-9]", page.read_text()):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if base not in exported and not any(m.startswith(base + "_") for m in exported):  # families: kv_transfer_*
                problems.append(f"{page.relative_to(ROOT)}: {name}")
    assert not problems, problems


def test_every_route_the_prose_names_exists():
    server, router = docs_gen.server_openapi()["paths"], docs_gen.router_openapi()["paths"]
    routes = {(m.upper(), re.sub(r"\{\w+\}", "{}", p)) for paths in (server, router) for p, ops in paths.items()
              for m in ops}
    routes |= {("GET", "/openapi.json")}
    problems = []
    for page in _prose_pages():
        for method, path in re.findall(r"\b(GET|POST) (/[a-z0-9_/{}.]+[a-z0-9_}])", page.read_text()):
            if (method, re.sub(r"\{\w+\}", "{}", path)) not in routes:
                problems.append(f"{page.relative_to(ROOT)}: {method} {path}")
    assert not problems, problems


def test_every_repository_path_the_prose_names_exists():
    problems = []
    for page in _prose_pages():
        text = page.read_text()
        for m in re.finditer(r"`((?:deploy|docs|bench|scripts|moe_serve|launcher|attention|expert_parallel|tests)"
                             r"/[A-Za-z0-9_./-]*[A-Za-z0-9_])`", text):
            if text[max(0, m.start() - 9):m.start()].endswith("DeepEP's "):  # a file of DeepEP's repository
                continue
            if not (ROOT / m.group(1)).exists():
                problems.append(f"{page.relative_to(ROOT)}: {m.group(1)}")
    assert not problems, problems
