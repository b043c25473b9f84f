import subprocess
import sys

from tests.conftest import REPO


def test_generated_code_is_up_to_date(tmp_path):
    """Regenerating from protos/preload.proto gives exactly the committed files."""
    subprocess.run([sys.executable, str(REPO / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True)
    for name in ("preload_pb2.py", "preload_pb2.pyi", "preload_pb2_grpc.py"):
        committed = (REPO / "protos" / name).read_text()
        assert (tmp_path / name).read_text() == committed, \
            f"protos/{name} is stale: run `python scripts/gen_protos.py` and commit the result"

