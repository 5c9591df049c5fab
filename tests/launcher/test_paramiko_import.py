"""How a launch imports paramiko (`launcher.transport.connect.import_paramiko`): without
invoke and importlib.metadata, and with paramiko still knowing its own version."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def _run(code: str, *, path: Path | None = None) -> str:
    """``code`` in a fresh interpreter (imports are per process); its stdout."""
    prefix = f"import sys; sys.path.insert(0, {str(path)!r})\n" if path else ""
    done = subprocess.run([sys.executable, "-c", prefix + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def test_paramiko_knows_its_installed_version_and_neither_invoke_nor_metadata_is_imported():
    out = _run("""
        import sys
        from launcher.transport.connect import import_paramiko
        import_paramiko(allow_config_exec=False)
        import paramiko
        skipped = [m for m in ("invoke", "importlib.metadata") if sys.modules.get(m)]
        from importlib import metadata  # the real one, for whoever needs it later
        print(paramiko.__version__ == metadata.version("paramiko"), skipped,
              paramiko.Transport._CLIENT_ID == "paramiko_" + paramiko.__version__)
    """)
    assert out == "True [] True"


def test_a_package_without_a_dist_info_folder_gets_its_version_from_importlib_metadata(
        tmp_path):
    """Another installer's layout (an egg-info folder): the stand-in hands over."""
    (tmp_path / "eggpkg").mkdir()
    (tmp_path / "eggpkg" / "__init__.py").write_text(
        "from importlib import metadata\n__version__ = metadata.version('eggpkg')\n")
    (tmp_path / "eggpkg-1.2.3.egg-info").mkdir()
    (tmp_path / "eggpkg-1.2.3.egg-info" / "PKG-INFO").write_text(
        "Metadata-Version: 1.1\nName: eggpkg\nVersion: 1.2.3\n")
    out = _run("""
        import sys, types
        from launcher.transport import connect
        stand_in = types.ModuleType("importlib.metadata")
        stand_in.version = connect._installed_version
        sys.modules["importlib.metadata"] = stand_in
        import eggpkg
        print(eggpkg.__version__, sys.modules["importlib.metadata"] is not stand_in)
    """, path=tmp_path)
    assert out == "1.2.3 True"


def test_a_launch_that_allows_config_exec_gets_paramiko_with_invoke():
    """`Match exec` lines run through invoke (paramiko's dependency) when they are allowed."""
    out = _run("""
        import sys
        from launcher.transport.connect import import_paramiko
        import_paramiko(allow_config_exec=True)
        print(sys.modules.get("invoke") is not None)
    """)
    assert out == "True"
