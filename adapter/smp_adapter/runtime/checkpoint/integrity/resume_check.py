"""A resume's digest check, in every rank, around the engine's load (``start_check`` before it,
``Check.source`` for each file the engine reads, ``Check.finish`` after it; runtime/checkpoint/dirs.py
runs them, the engine reads through the ``CheckpointIO`` of checkpoint/io.py that holds the Check): the
manifest, the file list, sizes and small files before the engine reads anything; the engine's files
hashed while it reads them (as read, ``hashing_io.HashingReader``, or on spare cores beside the
load, integrity/spare_cores.py); one all-reduce of every chunk's state gives every rank the
verdict before the resume returns, so all ranks raise the same error naming the file (none is left
waiting in a later collective); only chunks no rank read (another layout's resume) are split among
the ranks and hashed after. The records and the one-process checks: integrity/manifest.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from smp_adapter.errors import SMPCheckpointError
from smp_adapter.runtime.agreement import max_over_ranks
from smp_adapter.runtime.checkpoint.integrity.manifest import (ALGORITHM, FILES, MANIFEST, Problem, agree,
                                                    check_contents, check_files, check_sizes, differs, extra_files,
                                                    has_digests, read_manifest, refusal, shares,
                                                    skipped, units_of, used_unchecked)
from smp_adapter.runtime.checkpoint.integrity.hashing_io import HashingReader
from smp_adapter.runtime.checkpoint.integrity.records import due_units, hasher, small
from smp_adapter.runtime.checkpoint.integrity.spare_cores import SpareCoreHasher, hashing_threads

OK, DAMAGED = 1, 2  # a unit's state after the load, reduced over the ranks by maximum (0: no rank checked it)


class Check:
    """A resume's check, in two collective halves around the engine's load (``start_check``, then
    ``finish``): what costs no large read (the manifest, every file there with its size, no file
    added, the contents of the small files: ``checked_before``) is settled before the engine reads
    anything. During the load (``source``, through the engine's ``CheckpointIO``), torch.load reads each other
    recorded file through a reader that hashes the bytes just read, while they are in the CPU's cache (a second
    pass through a memory map costs more, and on a busy core that is the whole cost of the check), or, where the
    rank has spare cores, hands the file to threads that hash it beside the load (integrity/spare_cores.py).
    ``finish`` reduces over the ranks, in one all-reduce, which units (chunks, or whole files) every rank has
    checked and which were damaged: every rank then holds the same verdict, and returns or raises the same error
    before the resume returns, i.e. before a training step uses a value. Only when some unit was read by no rank
    (another layout's resume, reading the layout-independent pieces) are those split among the ranks and hashed,
    and the problems agreed once more."""

    def __init__(self, folder: Path, manifest: dict, action: str, rank: int, world_size: int, local_ranks: int = 1):
        self.folder, self.manifest, self._action, self._world, self._rank = folder, manifest, action, world_size, rank
        self.root = Path(folder).resolve()
        self.readers, self.read_whole = [], set()
        self._active = manifest is not None and has_digests(manifest) and not skipped()
        self.checked_before = {n for n, record in manifest[FILES].items() if small(record)} if self._active else set()
        threads = hashing_threads(local_ranks) if self._active else 0
        self.spare_cores = SpareCoreHasher(threads) if threads else None  # else hashed as read (HashingReader)

    @contextlib.contextmanager
    def loading(self):
        """Around the engine's load: an exception stops the spare cores' hashing of this resume."""
        try:
            yield
        except BaseException:
            if self.spare_cores is not None:
                self.spare_cores.cancel()
            raise

    @contextlib.contextmanager
    def source(self, path, shared_by: tuple[int, int] = (0, 1)):
        """``with check.source(path) as source: torch.load(source, ...)``: a reader that hashes the bytes
        torch.load reads (``HashingReader``) when ``path`` is a recorded file of this checkpoint not
        checked yet; otherwise the path itself (the file handed to spare cores, or nothing to check).
        ``shared_by`` = (position, count): the engine reads this file whole on ``count`` ranks, and this
        one hashes every count-th chunk (a chunk no rank hashed is checked after the load all the same)."""
        reader = None
        if self._active:
            path_ = Path(path).resolve()
            if path_.is_relative_to(self.root):
                name = path_.relative_to(self.root).as_posix()
                record = self.manifest[FILES].get(name)
                if record is not None and name not in self.checked_before and (name, shared_by) not in self.read_whole:
                    if self.spare_cores is not None:  # hashed beside the load; torch.load reads the path itself
                        self.readers.append((name, self.spare_cores.submit(path_, self.manifest[ALGORITHM], record,
                                                                           shared_by)))
                        self.read_whole.add((name, shared_by))
                    else:
                        reader = HashingReader(path_, self.manifest[ALGORITHM], record, shared_by)
                        self.readers.append((name, reader))
        try:
            yield reader if reader is not None else path
        finally:
            if reader is not None:
                reader.close()
                # read again later (DeepSpeed reads its model file twice: once to check the mp size), it
                # is not hashed again when this read checked every chunk it was to
                if all(i in reader.checked for i in due_units(record, shared_by)):
                    self.read_whole.add((name, shared_by))

    def every_problem(self) -> list:
        """Not collective: every file checked by this rank alone, for a rank whose engine could not read a
        file (the other ranks may be inside the engine's collectives): it ends with the digest error."""
        if self.manifest is None or not has_digests(self.manifest) or skipped():
            return []
        return sorted(check_files(self.folder, self.manifest, sorted(self.manifest[FILES])), key=lambda p: p.file)

    def finish(self) -> dict:
        """Collective: every rank returns the manifest, or every rank raises the same error."""
        problems = self._verdict() if self._active else agree([], self._world)
        if problems:
            raise refusal(self.folder, problems, self._action)
        return self.manifest

    def _verdict(self) -> list:
        files, algorithm = self.manifest[FILES], self.manifest[ALGORITHM]
        every = units_of(files, sorted(files))  # the same list on every rank: the manifest's
        state = {u: OK for u in every if u[0] in self.checked_before}
        if self.spare_cores is not None:
            self.spare_cores.wait()
        unreadable = []
        for name, reader in self.readers:
            unreadable += [Problem(name, f"could not be checked: {exc}") for exc in getattr(reader, "errors", ())]
            for index, ok in reader.checked.items():
                state[(name, index)] = max(state.get((name, index), 0), OK if ok else DAMAGED)
        state = dict(zip(every, max_over_ranks([state.get(u, 0) for u in every], self._world)))
        damaged: dict = {}
        for (name, index), value in state.items():
            if value == DAMAGED:
                damaged.setdefault(name, []).append(index)
        problems = [Problem(name, differs(algorithm, files[name], bad)) for name, bad in sorted(damaged.items())]
        unread = {u for u, value in state.items() if not value}
        if not unread:
            return problems  # the same on every rank: no more collectives
        problems += unreadable  # a rank's hashing thread could not read a file: its chunks are unread everywhere
        rest = {name: files[name] for name, _ in unread}  # ``shares`` orders them, the same on every rank
        try:
            problems += check_contents(self.folder, self.manifest,
                                       [u for u in shares(rest, self._world)[self._rank] if u in unread])
        except (OSError, ValueError, SMPCheckpointError) as exc:  # a file replaced while it was read
            problems += [Problem(MANIFEST, f"could not be checked: {exc}")]
        return agree(problems, self._world)


def start_check(folder: Path, action: str, rank: int, world_size: int, local_ranks: int = 1) -> Check:
    """Collective: refuse, on every rank, a checkpoint whose manifest, file list, sizes or small
    files are wrong, before the engine reads anything; then the ``Check`` of the rest."""
    folder = Path(folder)
    manifest, problems = read_manifest(folder)
    checked_units = 0
    if manifest is not None and used_unchecked(folder, manifest, problems, rank):
        problems = []
    elif not problems:
        try:
            hasher(manifest[ALGORITHM])  # an algorithm this process cannot compute: refused now
            files = manifest[FILES]
            share = shares(files, world_size)[rank]
            checked_units = len(units_of(files, files))
            problems = check_sizes(folder, manifest, share) + (extra_files(folder, manifest) if rank == 0 else [])
            # this rank's small files are hashed now: reading one costs microseconds, less than finding
            # out after the load whether some rank's engine read it (no engine reads the RNG states
            # and user content, read after the verdict, nor DeepSpeed's zero_to_fp32.py, nor, in the
            # same layout, the layout-independent index)
            problems = problems or check_contents(folder, manifest, [u for u in share if small(files[u[0]])])
        except SMPCheckpointError as exc:
            problems = [Problem(MANIFEST, str(exc))]
        except (OSError, ValueError) as exc:  # a file replaced between its stat and its read
            problems = [Problem(MANIFEST, f"could not be checked: {exc}")]
    problems = agree(problems, world_size, same=checked_units)  # ``finish`` reduces one value per unit
    if problems:
        raise refusal(folder, problems, action)
    return Check(folder, manifest, action, rank, world_size, local_ranks)


def require_intact_everywhere(folder: Path, action: str, rank: int, world_size: int) -> dict:
    """Collective (every rank calls it): the files split among the ranks, each rank checks its share,
    and the problems are gathered, so all ranks return or all raise the same error."""
    return start_check(folder, action, rank, world_size).finish()
