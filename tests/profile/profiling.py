"""What the `tidegate profile` end-to-end files share: the command, its files, its timeout.

The end-to-end tests are three files (test_profile_e2e.py: the embeddings round trip and
what its outputs drive; test_profile_generation_e2e.py: generation and Ctrl-C;
test_profile_minilm_e2e.py: the real model) so that ``--dist loadfile`` can run them on
different workers: together they were the longest file of the suite.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.procs import TIDEGATE, child_env

# A whole profile: about a minute idle, over four beside two CPU hogs; this is far beyond.
PROFILE_TIMEOUT_S = 900
FILES = {"profile.json", "recommended.yaml", "report.md", "report.png"}


def run_profile(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TIDEGATE, "profile", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=PROFILE_TIMEOUT_S,
        check=False,
    )


def write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path
