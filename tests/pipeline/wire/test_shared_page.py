"""The sealed parameter page (pipeline.wire.shared_page): a malformed offer is refused before anything is
opened, a worker's view reads what the server writes, its own writes stay its own until a refresh drops
them, and a closed page cannot be mapped any more."""
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
        assert torch.equal(view.tensor, torch.arange(16.0))
        view.close()
    finally:
        page.close()
    with pytest.raises((OSError, ValueError)):  # ValueError: the fd number reused, by another file
        shared_page.attach(good)  # closed: no worker may map it any more


def test_a_workers_own_writes_stay_in_its_view_until_a_refresh_drops_them() -> None:
    count = 10_000  # ten 4 KB pages
    page = shared_page.SharedPage(count)
    page.tensor.copy_(torch.arange(float(count)))
    mine, peer = shared_page.attach(page.offer()), shared_page.attach(page.offer())
    try:
        assert mine.written_pages() is None
        mine.tensor[5] = -1.0  # what a model clamping its own weights in forward does
        mine.tensor[9_000] = -2.0
        assert page.tensor[5] == 5.0 and peer.tensor[5] == 5.0 and peer.tensor[9_000] == 9_000.0
        first, end = mine.written_pages()
        assert first == 0 and end == (shared_page.HEADER + 4 * 9_000) // 4096 + 1
        page.tensor.add_(1.0)  # the next version: pages this worker did not write follow it
        assert mine.tensor[4_000] == 4_001.0 and mine.tensor[5] == -1.0
        mine.refresh()
        assert torch.equal(mine.tensor, page.tensor) and torch.equal(peer.tensor, page.tensor)
        assert mine.written_pages() is None and mine.refreshed == 1
        mine.refresh()  # nothing written since: nothing dropped
        assert mine.refreshed == 1
        page.tensor.mul_(2.0)
        assert torch.equal(mine.tensor, page.tensor)  # dropped pages read the server's page again
    finally:
        mine.close()
        peer.close()
        page.close()


@pytest.mark.parametrize("reported", [None, (0, 2)])
def test_a_pagemap_that_does_not_show_the_workers_writes_makes_it_decline_the_page(monkeypatch, reported) -> None:
    page = shared_page.SharedPage(2_000)
    try:
        monkeypatch.setattr(shared_page.PageView, "written_pages", lambda self: reported)
        with pytest.raises(OSError, match="pagemap"):
            shared_page.attach(page.offer())
    finally:
        page.close()
