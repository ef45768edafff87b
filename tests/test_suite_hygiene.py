"""The test command leaves nothing behind: the temporary directories of passing tests are deleted
and Ray's session folders go to a directory the run deletes (tests/conftest.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def test_temporary_directories_are_kept_only_for_failed_tests(request):
    assert request.config.getini("tmp_path_retention_policy") == "failed"


def test_ray_writes_under_a_directory_of_the_test_runs_own(ray_temp_dir, tmp_path_factory):
    path = Path(os.environ["RAY_TMPDIR"])
    assert path == ray_temp_dir and path.is_dir()
    base = tmp_path_factory.getbasetemp()
    assert path == base / "ray" or (path.parent == Path(tempfile.gettempdir()) and path.name.startswith("fh-ray-"))
    assert path != Path(tempfile.gettempdir())  # never the system temp folder Ray shares by default
