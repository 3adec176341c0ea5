"""The sealed parameter page (pipeline.wire.shared_page): a malformed offer is refused before anything is
opened, a worker's view reads what the server writes, and a closed page cannot be mapped any more."""
from __future__ import annotations

import pytest
import torch

from pipeline.wire import shared_page

pytestmark = pytest.mark.skipif(not shared_page.supported(), reason="the shared page needs Linux memfd seals")


def test_a_malformed_page_offer_is_declined_before_anything_is_opened() -> None:
    page = shared_page.SharedPage(16)
    good = page.offer()
    try:
        for bad in ({**good, "page": "/etc/passwd"}, {**good, "page": good["page"] + "/../x"},
                    {**good, "page_bytes": good["page_bytes"] + 1}, {**good, "page_token": "00"}):
            with pytest.raises(ValueError, match="malformed"):
                shared_page.attach(bad)
        with pytest.raises(ValueError, match="another token"):
            shared_page.attach({**good, "page_token": "00" * 16})
        view = shared_page.attach(good)
        page.tensor.copy_(torch.arange(16.0))  # the server's write is what the worker reads
        assert torch.equal(view, torch.arange(16.0))
    finally:
        page.close()
    with pytest.raises((OSError, ValueError)):  # ValueError: the fd number reused, by another file
        shared_page.attach(good)  # closed: no worker may map it any more
