"""Imports flow one way: preload_cli -> worker -> preload_daemon -> kernels."""

import ast
import subprocess
import sys

from tests.conftest import REPO, run_python

LOWER = ("preload_daemon", "kernels")


def forbidden_imports(package: str, forbidden: tuple[str, ...]) -> list[str]:
    """'path:line: what' for every import under `package` of a module in `forbidden`, and every
    load of code by path or by computed name."""
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        source = path.read_text()
        where = path.relative_to(REPO)
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{where}:{node.lineno}: imports {n}" for n in names
                      if any(n == f or n.startswith(f + ".") for f in forbidden)]
        for needle in ("spec_from_file_location", "import_module("):
            if needle in source:
                found.append(f"{where}: uses {needle}")
    return found


def test_lower_layers_import_without_upper_layers():
    """Importing every module of preload_daemon and kernels loads nothing from worker, scripts or preload_cli."""
    code = (
        "import importlib, pkgutil, sys\n"
        f"for name in {LOWER!r}:\n"
        "    package = importlib.import_module(name)\n"
        "    for info in pkgutil.walk_packages(package.__path__, name + '.'):\n"
        "        if not info.name.endswith('.__main__'):\n"
        "            importlib.import_module(info.name)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'worker', 'scripts', 'preload_cli'}))\n"
    )
    assert run_python(code, timeout=300).splitlines()[-1] == "[]"


def test_daemon_and_kernels_do_not_import_upper_layers():
    """No module in preload_daemon/ or kernels/ imports worker, scripts or preload_cli, or loads code by path."""
    found = [f for package in LOWER for f in forbidden_imports(package, ("worker", "scripts", "preload_cli"))]
    assert not found, "\n".join(found)


def test_worker_does_not_import_the_cli():
    """No module in worker/ imports preload_cli or scripts, or loads code by path."""
    found = forbidden_imports("worker", ("preload_cli", "scripts"))
    assert not found, "\n".join(found)


def test_worker_leaves_layout_to_the_daemon():
    """Workers say what they want and the daemon finds the variant: no worker module reaches into
    the daemon's store or server (to rebuild its cache keys, say)."""
    found = forbidden_imports("worker", ("preload_daemon.store", "preload_daemon.leasing", "preload_daemon.server",
                                         "preload_daemon.stream"))
    assert not found, "\n".join(found)


def test_the_command_line_starts_without_torch():
    """Parsing a command (and starting an engine's other TP ranks) imports no torch: the ranks'
    start-up overlaps rank 0's, and `preload --help` answers at once."""
    code = ("import sys\nfrom preload_cli.main import build_parser\n"
            "build_parser().parse_args(['engine', '--tp-size', '2'])\n"
            "from worker.config import EngineConfig\nfrom preload_daemon.config import resolve_devices\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    imported = run_python(code)
    assert imported == "[]", f"torch imported: {imported}"


def test_a_command_imports_only_its_own_modules():
    """Only the command being run has its parser built: `preload snapshot restore` (on every
    restore's path to ready) imports none of the other commands' modules, and `preload --help`
    still lists every command."""
    code = ("import sys\nfrom preload_cli.main import build_parser\n"
            "build_parser(argv=['snapshot', 'restore', 'D']).parse_args(['snapshot', 'restore', 'D'])\n"
            "print(sorted(m for m in sys.modules if m.startswith(('preload_cli.', 'preload_daemon.arch', 'grpc', "
            "'torch'))))")
    imported = run_python(code)
    # argtypes: the argument types every command's parser shares (argparse and math only)
    assert imported == "['preload_cli.argtypes', 'preload_cli.main', 'preload_cli.snapshot_commands']", imported
    listed = subprocess.run([sys.executable, "-m", "preload_cli", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    from preload_cli.main import HELP
    assert listed.returncode == 0 and all(f"    {name}" in listed.stdout for name in HELP), listed.stdout
