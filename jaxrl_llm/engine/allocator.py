"""The page pool's bookkeeping on the host: which pages are free, and how many sequences read each page.

A page is freed when its last reader releases it. The G samples of a group hold references to their prompt's
full pages (the prompt is prefilled once); a sample that must write into a shared page (the prompt's last,
partial page) gets its own copy first (`fork`: copy on write). A reservation keeps pages back for a sequence's
growth so that an admitted sequence never waits for memory mid-decode: the scheduler admits work only while
`available()` covers it, and queues it otherwise.
"""

from __future__ import annotations

import dataclasses


class OutOfPages(RuntimeError):
    """More pages were asked for than are free (the scheduler checks `available()` first)."""


@dataclasses.dataclass
class PageAllocator:
    """Free list and reference counts of `num_pages` pages. Page 0 is never handed out: padded page-table
    entries point at it, and nothing reads it unmasked."""

    num_pages: int
    refs: list[int] = dataclasses.field(init=False)
    free: list[int] = dataclasses.field(init=False)
    reserved: int = 0

    def __post_init__(self) -> None:
        if self.num_pages < 2:
            raise ValueError(f"the page pool needs at least 2 pages, got {self.num_pages}")
        self.refs = [0] * self.num_pages
        self.free = list(range(self.num_pages - 1, 0, -1))  # pop() hands out 1, 2, 3, ...

    def available(self) -> int:
        """Pages that can still be promised: free and not reserved."""
        return len(self.free) - self.reserved

    def in_use(self) -> int:
        return self.num_pages - 1 - len(self.free)

    def reserve(self, count: int) -> None:
        if count > self.available():
            raise OutOfPages(f"cannot reserve {count} pages: {self.available()} available")
        self.reserved += count

    def allocate(self, count: int, *, reserved: bool = False) -> list[int]:
        """`count` fresh pages (reference count 1), from the caller's reservation when `reserved`."""
        if count > (len(self.free) if reserved else self.available()):
            raise OutOfPages(f"cannot allocate {count} pages: {self.available()} available")
        if reserved:
            self.reserved -= count
        pages = [self.free.pop() for _ in range(count)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more reader of each of `pages`."""
        for p in pages:
            if self.refs[p] < 1:
                raise ValueError(f"page {p} is not allocated")
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """One reader fewer of each of `pages`; a page nobody reads is free again."""
        for p in pages:
            if self.refs[p] < 1:
                raise ValueError(f"page {p} released more often than allocated")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def unreserve(self, count: int) -> None:
        self.reserved -= count
        if self.reserved < 0:
            raise ValueError("more pages unreserved than reserved")
