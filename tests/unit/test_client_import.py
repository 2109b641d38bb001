import subprocess
import sys


def test_client_imports_without_heavy_dependencies():
    code = (
        "import sys, temper.client\n"
        "from temper.client import ServiceClient, TrainingClient, SamplingClient, types\n"
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'sqlalchemy', 'safetensors') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"temper.client pulled in: {out.stdout.strip()}"
