"""The shipped texts speak of the project alone: no README, doc page, module, script or
data note says how the project was written (work sessions, coding agents, an assistant)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Phrases about how the text was produced. Each is specific enough not to match what
# a KV-cache allocator's texts legitimately say ("SGLang's helper", "openai/gpt-oss",
# "hybrid SWA LLMs", "a Python session" stay legal).
FORBIDDEN = [
    r"\b(this|that|the|a|each|one|another|other|previous|earlier|later|next|helper|lead|coding|agent) sessions?\b",
    r"\bagents?\b",
    r"\bhelper (session|engineer|agent|task)s?\b",
    r"\blead engineer\b",
    r"\bthe lead\b",
    r"\b(Claude|Anthropic|ChatGPT|Copilot)\b",
    r"\b(LLM|AI|language[- ]model|assistant)[- ](written|generated|assisted|authored)\b",
    r"\b(written|generated|authored|drafted) (by|with) (an? )?(LLM|AI|language model|assistant|agent)\b",
]
PATTERN = re.compile("|".join(f"(?:{p})" for p in FORBIDDEN), re.IGNORECASE)

SHIPPED = ["README.md", "SPEC.md", "setup.py", "pyproject.toml", "CMakeLists.txt", "docs/**/*.md",
           "swa_ext/**/*.py", "swa_ext/data/*.json", "bench/**/*.py", "bench/**/*.cpp", "scripts/*",
           "csrc/**/*.h", "csrc/**/*.cpp", "csrc/**/*.cu", "csrc/**/*.cuh"]


def shipped_files() -> list[Path]:
    return sorted({p for pattern in SHIPPED for p in ROOT.glob(pattern) if p.is_file()})


def offending_lines(path: Path, root: Path = ROOT) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    return [f"{path.relative_to(root)}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if PATTERN.search(line)]


def test_the_check_sees_the_shipped_texts():
    names = {str(p.relative_to(ROOT)) for p in shipped_files()}
    assert {"README.md", "SPEC.md", "swa_ext/simulator/node.py", "swa_ext/data/swa_model_configs.json",
            "scripts/run-simulator.sh"} <= names


def test_no_shipped_text_says_how_the_project_was_written():
    found = [line for path in shipped_files() for line in offending_lines(path)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("line", [
    "figures not confirmed from a config/code source in this session.",
    "# The GPU check, for a session lent the device machine",
    "Written by Claude in one sitting.",
    "the lead will merge it",
    "An LLM-generated table.",
    "as the coding agent found",
])
def test_a_planted_line_is_caught(line, tmp_path):
    planted = tmp_path / "README.md"
    planted.write_text(f"# swa_ext\n\n{line}\n", encoding="utf-8")
    assert offending_lines(planted, tmp_path) == [f"README.md:3: {line}"]


@pytest.mark.parametrize("line", [
    '"""Benchmark helpers for swa_ext."""',
    "Pages a batch needs (SGLang's helper of that name).",
    "github openai/gpt-oss gpt_oss/torch/model.py",
    "allocator for hybrid sliding-window-attention LLMs",
    "huggingface.co/Alignment-Lab-AI/idfkphi4kiguess config.json",
    "paste it into a Python session",
    "the leading page of the window",
])
def test_legitimate_lines_pass(line, tmp_path):
    planted = tmp_path / "README.md"
    planted.write_text(line + "\n", encoding="utf-8")
    assert offending_lines(planted, tmp_path) == []

