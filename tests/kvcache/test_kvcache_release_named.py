"""kvcache's docstrings name the release it follows: the newest ci/install-vllm.sh installs."""

import re
from pathlib import Path

import kvfuzz.kvcache
import kvfuzz.kvcache.request
import kvfuzz.kvcache.scheduler

REPO = Path(__file__).resolve().parents[2]


def test_docstrings_name_the_newest_supported_release() -> None:
    newest = re.search(r"\(default: (\d+\.\d+\.\d+)\)", (REPO / "ci" / "install-vllm.sh")
                       .read_text()).group(1)
    for doc in (kvfuzz.kvcache.__doc__, kvfuzz.kvcache.request.RequestStatus.__doc__,
                kvfuzz.kvcache.scheduler.__doc__):
        assert re.findall(r"vLLM (\d+\.\d+\.\d+)", doc) == [newest], doc
