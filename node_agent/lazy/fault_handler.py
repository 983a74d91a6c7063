"""The fault handler: fills a lazily restored container's memory through its processes' userfaultfds.

CRIU's restore (``runc restore --lazy-pages``) connects to the plan's
``work/lazy-pages.socket`` and, for each process it restores, sends the
process's id in the checkpoint (a native int; negative for a zombie) and
then its userfaultfd (SCM_RIGHTS, with one byte). Once every process's lazy
memory is registered and the processes are about to run, it sends the word
``RESTORE_FINISHED``.

From then on this handler owns the processes' missing memory:

* **faults** are read from every userfaultfd in one thread and answered in
  a pool of workers, several at once: a fault claims the whole chunk of the
  pages file that holds its bytes (at least ``FAULT_WINDOW``), not a page:
  every waiting page whose bytes that chunk holds, in whichever mapping it
  lies, so each chunk is read, verified and decoded once however faults and
  the stream come at it (a framework's memory is hundreds of small
  mappings); it copies them with one ``UFFDIO_COPY`` per piece of chunk. A
  fault on memory the checkpoint holds no bytes for gets the zero page,
  also when it comes as the transfer ends;
* **the stream** copies everything else in the background, ``STREAMS``
  threads claiming ``STREAM_WINDOW`` of whole chunks at a time, starting
  where the last fault's claim ended (a thread walking its memory finds it
  already there) and wrapping around. It starts as soon as a
  process's userfaultfd arrives: until the restore has finished, memory not
  registered yet (ENOENT) goes back to the waiting spans and is tried again
  a moment later; after that, ENOENT means the mapping is gone;
* **events** keep the books: FORK gives a child that inherits the parent's
  missing memory (and its own userfaultfd), REMAP moves spans, REMOVE and
  UNMAP drop them.

Every byte copied comes from a chunk verified against its digest
(`chunks`). Each userfaultfd is handed to ``hand_over`` (the agent keeps a
duplicate) before any of its faults is served. The transfer is over when
the restore has finished and no process waits for a byte.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final

from node_agent.lazy import pagemap, uffd
from node_agent.lazy.chunks import PAGE_SIZE, ChunkCache, SourceError
from node_agent.lazy.spans import Span, Spans

log = logging.getLogger("node_agent.lazy.source")

SOCKET_NAME: Final = "lazy-pages.socket"  # in the restore's work directory, as CRIU names it
RESTORE_FINISHED: Final = 0x52535446
FAULT_WINDOW: Final = 1 << 20  # a fault claims whole chunks, at least this much
STREAM_WINDOW: Final = 4 << 20
FAULT_WORKERS: Final = 4
STREAMS: Final = 2  # one copies while the other waits for its chunks: the copy and the reading overlap
IDLE_WAIT: Final = 0.05
"""How long an idle stream waits before it looks again; a process's memory arriving or a job ending wakes it."""
_WORD: Final = struct.Struct("=i")


@dataclass(eq=False)
class Task:
    """One restored process (or a child it forked since) and its missing memory."""

    task_id: int  # the id in the checkpoint whose pagemap it has
    fd: int
    pm: pagemap.Pagemap
    cache: ChunkCache
    pending: Spans
    jobs: list[Spans] = field(default_factory=list)
    hint: int = 0  # where the stream goes on
    last_fault: int = -1  # where the last fault's window ended
    gone: bool = False

    def file_offset(self, img: int) -> int:
        ext = self.pm.find(img)
        if ext is None or not ext.lazy:
            raise SourceError(f"task {self.task_id}: no lazy pages at {img:#x} in the checkpoint")
        return ext.offset + (img - ext.vaddr)

    def extent_end(self, img: int) -> int:
        ext = self.pm.find(img)
        return ext.end if ext is not None else img


class Handler:
    def __init__(
        self, maps: dict[int, pagemap.Pagemap], files: dict[int, ChunkCache], images: str,
        hand_over: Callable[[int, int], None],
    ) -> None:
        self.maps = maps
        self.files = files
        self.images = images
        self.hand_over = hand_over
        self.tasks: dict[int, Task] = {}  # by fd
        self.lock = threading.Condition()
        self.finished = False
        self.stopping = False
        self.error: str | None = None
        self.restore_failed = False  # the failure was the restore's own end (CRIU's), not the source's
        self.copied = 0  # bytes
        self.faults = 0
        self.total_pages = 0
        self.epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.epoll.register(self._wake_r, select.EPOLLIN)
        self.pool = ThreadPoolExecutor(max_workers=FAULT_WORKERS, thread_name_prefix="fault")
        self._after = False  # the transfer is over: the few faults left (zero pages) are answered inline
        self._retry: list[tuple[Task, int]] = []
        self._prepared: dict[int, Spans] = {}  # by task id: its missing memory, cut at its mappings (`prepare`)

    # -- set-up -------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Cut each task's lazy extents at its mappings now, before the restore connects, for `add_task` to take:
        a framework's address space has some 1,700 mappings, and reading them took some 20 ms between CRIU
        handing over a process's memory and the first page moving. A task whose images cannot be read here
        is left to `add_task`, which reads them again and says why."""
        for task_id, pm in self.maps.items():
            try:
                ranges = pagemap.lazy_ranges(pm, pagemap.load_vmas(self.images, task_id))
            except (OSError, pagemap.PagemapError):
                continue
            self._prepared[task_id] = Spans(Span(lo, hi, lo) for lo, hi in ranges)

    def add_task(self, task_id: int, fd: int) -> None:
        """A restored process's userfaultfd, from the restore."""
        pm = self.maps.get(task_id)
        if pm is None or task_id not in self.files:
            os.close(fd)
            raise SourceError(f"the restore sent the memory of task {task_id}, which the checkpoint does not hold")
        pending = self._prepared.pop(task_id, None)
        if pending is None:
            try:
                ranges = pagemap.lazy_ranges(pm, pagemap.load_vmas(self.images, task_id))
            except (OSError, pagemap.PagemapError):
                os.close(fd)
                raise
            pending = Spans(Span(lo, hi, lo) for lo, hi in ranges)
        task = Task(task_id, fd, pm, self.files[task_id], pending)
        self.hand_over(fd, task_id)
        with self.lock:
            self.total_pages += task.pending.bytes // PAGE_SIZE
            self.tasks[fd] = task
            first = task.pending.first()
            if first is not None:
                task.cache.warm(task.file_offset(first.img))
            self.lock.notify_all()  # the streams start on it now
        self.epoll.register(fd, select.EPOLLIN)
        log.info("task %d: %d pages to fill", task_id, task.pending.bytes // PAGE_SIZE)

    def read_restore(self, conn: socket.socket) -> None:
        """Take the restore's userfaultfds until it says it finished (in a thread of its own)."""
        words = _Words(conn)
        try:
            while True:
                word = words.int32()
                if word is None:
                    if not self.finished:
                        self.fail("the restore closed its connection before it finished (see its CRIU log)",
                                  restore=True)
                    return
                if word == RESTORE_FINISHED:
                    with self.lock:
                        self.finished = True
                        self.lock.notify_all()
                    log.info("the restore finished: %d tasks, %d of %d pages in", len(self.tasks),
                             self.copied // PAGE_SIZE, self.total_pages)
                    continue
                if word < 0:
                    continue  # a zombie: no memory to fill
                self.add_task(word, words.fd())
        except (OSError, SourceError, pagemap.PagemapError) as exc:
            self.fail(f"reading the restore's userfaultfds: {exc}")

    # -- running ------------------------------------------------------------------------------

    def run(self, restore: socket.socket) -> None:
        """Serve the restore connected on ``restore`` until every page is in; SourceError when serving cannot go on."""
        # The reader ends when the restore closes its end (CRIU exits): it is not waited for.
        threading.Thread(target=self.read_restore, args=(restore,), name="restore", daemon=True).start()
        streams = [threading.Thread(target=self._stream, name=f"stream-{i}", daemon=True) for i in range(STREAMS)]
        for stream in streams:
            stream.start()
        try:
            while True:
                with self.lock:
                    if self.error is not None or self.stopping:
                        break
                for fd, _ev in self.epoll.poll(1.0):
                    if fd == self._wake_r:
                        _drain(fd)
                        continue
                    task = self.tasks.get(fd)
                    if task is not None:
                        self._events(task)
        finally:
            with self.lock:
                self.stopping = True
                self.lock.notify_all()
            for stream in streams:
                stream.join()
            self.pool.shutdown(wait=True, cancel_futures=self.error is not None)
            self._after = True
        if self.error is not None:
            raise SourceError(self.error)

    def serve_until(self, released: Callable[[], bool], also: int = -1) -> None:
        """After the transfer: keep answering faults (zero pages) until ``released()`` says the duplicates are gone.

        ``also``: a descriptor whose input makes it ask again at once (the agent's answer).
        """
        if also >= 0:
            self.epoll.register(also, select.EPOLLIN)
        try:
            while not released():
                for fd, _ev in self.epoll.poll(0.05):
                    task = self.tasks.get(fd)
                    if task is not None:
                        self._events(task)
                with self.lock:
                    retry, self._retry = self._retry, []
                for task, addr in retry:
                    self._zero(task, addr, inline=True)
        finally:
            if also >= 0:
                self.epoll.unregister(also)

    def close(self) -> None:
        for fd in list(self.tasks):
            try:
                os.close(fd)
            except OSError:
                pass
        self.tasks.clear()
        self.epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def fail(self, message: str, *, restore: bool = False) -> None:
        """Serving cannot go on, for ``message`` (the first one stays); ``restore``: because the restore itself
        ended (CRIU failed on its own: its log, not this source, says why)."""
        with self.lock:
            if self.error is None:
                self.error = message
                self.restore_failed = restore
            self.lock.notify_all()
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # -- events -------------------------------------------------------------------------------

    def _events(self, task: Task) -> None:
        while True:
            try:
                msg = uffd.read(task.fd)
            except OSError as exc:
                if task.gone:
                    return
                self.fail(f"reading the userfaultfd of task {task.task_id}: {exc}")
                return
            if msg is None:
                return
            if msg.event == uffd.PAGEFAULT:
                self._fault(task, msg.address & ~(PAGE_SIZE - 1))
            elif msg.event == uffd.FORK:
                self._fork(task, msg.fd)
            elif msg.event == uffd.REMAP:
                with self.lock:
                    task.pending.remap(msg.start, msg.to, msg.end - msg.start)
                    for job in task.jobs:
                        job.remap(msg.start, msg.to, msg.end - msg.start)
            elif msg.event in (uffd.REMOVE, uffd.UNMAP):
                if msg.event == uffd.REMOVE:
                    err = uffd.unregister(task.fd, msg.start, msg.end - msg.start)
                    if err == errno.ENOMEM:
                        self._gone(task)
                    elif err:
                        self.fail(f"task {task.task_id}: cannot stop faults in {msg.start:#x}-{msg.end:#x}: "
                                  f"{os.strerror(err)}")
                with self.lock:
                    task.pending.take(msg.start, msg.end)
                    for job in task.jobs:
                        job.take(msg.start, msg.end)
            else:
                self.fail(f"task {task.task_id}: unexpected userfaultfd event {msg.event:#x}")

    def _fault(self, task: Task, addr: int) -> None:
        with self.lock:
            self.faults += 1
            # Faults that walk the memory in order (each near where the last
            # one's window ended) move the stream on and read ahead; scattered
            # ones leave the stream where it was and read only their chunk.
            walking = _near(addr, task.last_fault, FAULT_WINDOW)
            job = self._claim(task, addr, FAULT_WINDOW, move_stream=walking)
            if job is not None:
                task.last_fault = _end(job)
            elif any(j.find(addr) for j in task.jobs):
                return  # on its way: the copy wakes the thread
        if self._after:
            self._zero(task, addr, inline=True)
        elif job is not None:
            self.pool.submit(self._run_job, task, job, walking)
        else:
            self.pool.submit(self._zero, task, addr)

    def _fork(self, parent: Task, fd: int) -> None:
        with self.lock:
            waiting = parent.pending.copy()
            for job in parent.jobs:  # in flight for the parent: the child needs them too
                for s in job:
                    waiting.add(s)
            child = Task(parent.task_id, fd, parent.pm, parent.cache, waiting, hint=parent.hint)
            self.tasks[fd] = child
            self.lock.notify_all()
        self.hand_over(fd, parent.task_id)
        self.epoll.register(fd, select.EPOLLIN)

    def _gone(self, task: Task) -> None:
        with self.lock:
            task.gone = True
            task.pending = Spans()
            for job in task.jobs:
                job.take(0, 1 << 64)
            self.lock.notify_all()

    # -- copies -------------------------------------------------------------------------------

    def _claim(self, task: Task, addr: int, window: int, move_stream: bool = True) -> Spans | None:
        """Take the waiting memory of whole chunks around ``addr`` for one copy (lock held): the chunk of the
        pages file that holds ``addr``'s bytes and the next ones, until ``window`` bytes. Every waiting page
        whose bytes those chunks hold is taken, whichever mapping it is in, so that each chunk is read,
        verified and decoded once, however the process's faults and the stream come at it.

        ``move_stream``: the stream goes on where this window ends.
        """
        if task.gone:
            return None
        s = task.pending.find(addr)
        if s is None:
            return None
        lo, hi = task.cache.bounds(task.file_offset(s.image(addr)), window)
        job = Spans()
        for ext in task.pm.in_file(lo, hi):
            img_lo = ext.vaddr + max(0, lo - ext.offset)
            img_hi = ext.vaddr + min(ext.nr_pages * PAGE_SIZE, hi - ext.offset)
            for span in task.pending.take_image(img_lo, img_hi):
                job.add(span)
        if not job:  # cannot be: the span at addr is inside these chunks
            raise SourceError(f"task {task.task_id}: no waiting memory in the chunks of {addr:#x}")
        task.jobs.append(job)
        if move_stream:
            task.hint = _end(job)
        return job

    def _run_job(self, task: Task, job: Spans, ahead: bool = True) -> bool:
        """Copy a claimed window; False when its memory is not in place yet (before the restore finished).

        ``ahead``: read the next chunks ahead (the stream, and faults that walk in order).
        """
        try:
            self._copy_job(task, job, ahead)
        except _NotYet:
            return False
        except SourceError as exc:
            self.fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - a worker's failure must end the transfer, not vanish
            self.fail(f"task {task.task_id}: copying pages failed: {exc!r}")
        finally:
            with self.lock:
                if job in task.jobs:
                    task.jobs.remove(job)
                done = not task.pending and not task.jobs
                self.lock.notify_all()
            if done:  # every page of this process is in: its chunks need not stay in memory
                task.cache.release()
        return True

    def _copy_job(self, task: Task, job: Spans, ahead: bool) -> None:
        """Copy a claimed job: one run of image addresses within one extent of the pages file at a time."""
        while True:
            with self.lock:
                if not job:
                    return
                img_lo = min(s.img for s in job)
                img_hi = max(s.img + s.size for s in job)
            img_hi = min(img_hi, task.extent_end(img_lo))
            pos = img_lo
            for data, start, length in task.cache.pieces(task.file_offset(img_lo), img_hi - img_lo, ahead):
                self._copy_piece(task, job, pos, uffd.address_of(data) + start, length)
                pos += length
                if task.gone or self.stopping:
                    return
            with self.lock:  # every page of the run is in or was let go; never the same run twice
                job.drop_image(img_lo, img_hi)

    def _copy_piece(self, task: Task, job: Spans, img: int, base: int, length: int) -> None:
        done = 0
        cap = length  # smaller after ENOENT: the process may have split a mapping (mprotect) since
        while done < length:
            x = img + done
            with self.lock:
                if task.gone or self.stopping:
                    return
                span = next((s for s in job if s.img <= x < s.img + s.size), None)
                if span is None:  # dropped (removed, unmapped) or already in: skip to the next part still wanted
                    later = [s.img for s in job if x < s.img < img + length]
                    if not later:
                        return
                    done = min(later) - img
                    continue
                dst = span.start + (x - span.img)
                n = min(length - done, span.img + span.size - x, cap)
            copied, err = uffd.copy(task.fd, dst, base + done, n)
            with self.lock:
                job.drop_image(x, x + copied)
                self.copied += copied
                if err == 0 or err == errno.EAGAIN:
                    done += copied
                    cap = max(cap, 2 * n) if err == 0 else cap
                elif err == errno.EEXIST:  # already there (a child forked after its parent got it)
                    job.drop_image(x + copied, x + copied + PAGE_SIZE)
                    done += copied + PAGE_SIZE
                elif err == errno.ENOENT and n - copied > PAGE_SIZE:  # it may cross mappings: smaller steps
                    done += copied
                    cap = max(PAGE_SIZE, (n - copied) // 2 // PAGE_SIZE * PAGE_SIZE)
                elif err == errno.ENOENT and not self.finished:
                    # Not registered yet: the restore is still putting this
                    # memory in place. Back to the waiting spans, for later.
                    for rest in job:
                        task.pending.add(rest)
                    job.take(0, 1 << 64)
                    raise _NotYet()
                elif err == errno.ENOENT:  # no mapping for this page (an UNMAP on its way)
                    job.drop_image(x + copied, x + copied + PAGE_SIZE)
                    done += copied + PAGE_SIZE
                elif err in uffd.GONE:
                    pass
                else:
                    raise SourceError(f"task {task.task_id}: filling {n} bytes at {dst:#x} failed: {os.strerror(err)}")
            if err in uffd.GONE:
                self._gone(task)
                return
            if err == errno.EAGAIN and copied == 0:
                time.sleep(0.001)  # the map is changing: its event is read first

    def _zero(self, task: Task, addr: int, inline: bool = False) -> None:
        while not task.gone:
            if not inline and self.stopping:
                # The transfer ended while this fault waited for a worker: the thread that faulted
                # still waits, so the fault is answered after the transfer (serve_until), not dropped.
                with self.lock:
                    self._retry.append((task, addr))
                return
            err = uffd.zeropage(task.fd, addr, PAGE_SIZE)
            if err in uffd.GONE:
                self._gone(task)
            elif err == errno.EAGAIN:
                if inline:  # this thread reads the event that holds it up: later
                    self._retry.append((task, addr))
                    return
                time.sleep(0.001)
                continue
            elif err not in (0, errno.EEXIST, errno.ENOENT):
                self.fail(f"task {task.task_id}: zero page at {addr:#x} failed: {os.strerror(err)}")
            return

    # -- the stream ---------------------------------------------------------------------------

    def _stream(self) -> None:
        try:
            while True:
                with self.lock:
                    if self.stopping:
                        return
                    picked = self._next()
                    if picked is None:
                        if self.finished and not any(t.jobs for t in self.tasks.values()):
                            self.stopping = True  # every page is in
                            self._wake()
                            return
                        self.lock.wait(IDLE_WAIT)
                        continue
                if not self._run_job(*picked):
                    with self.lock:  # the restore is still placing the memory: a moment later
                        self.lock.wait(0.002)
        except Exception as exc:  # noqa: BLE001 - see _run_job
            self.fail(f"the background transfer failed: {exc!r}")

    def _next(self) -> tuple[Task, Spans] | None:
        for task in self.tasks.values():
            if task.gone or not task.pending:
                continue
            s = task.pending.at_or_after(task.hint)
            if s is None:
                continue
            addr = task.hint if s.start <= task.hint < s.end else s.start
            job = self._claim(task, addr, STREAM_WINDOW)
            if job is not None:
                return task, job
        return None


class _NotYet(Exception):
    """The memory a copy is for is not registered yet: the restore has not finished."""


class _Words:
    """The restore's stream: native ints, some followed by one byte carrying a descriptor."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = b""
        self.fds: list[int] = []

    def _fill(self, n: int) -> bool:
        while len(self.buf) < n:
            data, fds, _flags, _addr = socket.recv_fds(self.conn, n - len(self.buf), 4)
            self.fds.extend(fds)
            if not data:
                return False
            self.buf += data
        return True

    def int32(self) -> int | None:
        if not self._fill(_WORD.size):
            if self.buf:
                raise SourceError("the restore's connection ended mid-message")
            return None
        (word,) = _WORD.unpack(self.buf[:_WORD.size])
        self.buf = self.buf[_WORD.size:]
        return int(word)

    def fd(self) -> int:
        if not self._fill(1) or not self.fds:
            raise SourceError("the restore sent a process without its userfaultfd")
        self.buf = self.buf[1:]
        fd = self.fds.pop(0)
        for extra in self.fds:
            os.close(extra)
        self.fds.clear()
        return fd


def _end(job: Spans) -> int:
    return max(s.end for s in job)


def _near(addr: int, mark: int, window: int) -> bool:
    """Whether ``addr`` lies within a window either side of ``mark`` (where the last window ended)."""
    return mark >= 0 and mark - window <= addr < mark + window


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 64):
            pass
    except BlockingIOError:
        pass
