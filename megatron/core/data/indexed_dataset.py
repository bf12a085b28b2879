"""Memory-mapped indexed dataset: a flat ``.bin`` of token ids and an ``.idx`` describing its items.

The format is byte-compatible with Megatron's ``mmap`` indexed dataset. An *item* is one token
sequence (a whole document, or one sentence with ``--split-sentences``); a *document* is a run of
consecutive items.

``<prefix>.bin`` is the concatenation of every item's token array in the dataset dtype, C order,
no header. ``<prefix>.idx`` is little-endian, unaligned::

    offset  size            content
    0       9               magic b"MMIDIDX\\x00\\x00"
    9       8               version <Q = 1
    17      1               dtype code <B (see DTYPE_CODES)
    18      8               len <Q        = number of items N
    26      8               doc_count <Q  = D = number of documents + 1
    34      4 N             sizes    int32, tokens per item
    34+4N   8 N             pointers int64, byte offset of each item in .bin
                            (pointers[i] = itemsize * sum(sizes[:i]))
    34+12N  8 D             doc_idx  int64, item index where each document starts;
                            doc_idx[0] = 0 and doc_idx[-1] = N

Every offset is 64-bit, so a ``.bin`` may exceed 4 GiB. The builder writes both files under
temporary names and renames them only when complete (the ``.idx`` last), so an interrupted run
leaves nothing that opens as a finished dataset.
"""
import array
import contextlib
import os
import shutil
import secrets
import struct

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, len, doc_count: 34 bytes
_WARMUP_CHUNK_BYTES = 100 * 1024 * 1024
# The open-time sample of token ids (check_vocabulary): the first ids of items spread over the file.
_SAMPLED_ITEMS = 256
_SAMPLED_TOKENS_PER_ITEM = 16

# Codes 6 and 7 were np.float and np.double in Megatron, both float64; we write 7 for float64,
# the code Megatron's writer produced for it.
DTYPE_CODES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float64),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items() if code != 6}


class IndexedDatasetError(ValueError):
    """A dataset file is missing, corrupt or inconsistent; the message names the file.

    Raised in a DataLoader worker, it reaches the main process re-made from a text holding the
    worker's traceback ("Caught IndexedDatasetError in DataLoader worker process 0. Original
    Traceback ..."); the message keeps the traceback's last line, its own, so it stays one line.
    """

    def __init__(self, message: str = ""):
        if message.startswith("Caught ") and "\nOriginal Traceback" in message:
            message = message.rstrip().rsplit(f"{IndexedDatasetError.__name__}: ", 1)[-1]
        super().__init__(message)


def best_fitting_dtype(vocab_size):
    """Smallest token dtype for a vocabulary: uint16 if ``vocab_size < 65500``, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix):
    """Path of the token data of ``prefix``: ``prefix + ".bin"``."""
    return prefix + ".bin"


def index_file_path(prefix):
    """Path of the index of ``prefix``: ``prefix + ".idx"``."""
    return prefix + ".idx"


def dtype_code(dtype, path="<dataset>"):
    """The ``.idx`` dtype code of ``dtype``; IndexedDatasetError naming ``path`` if it has none."""
    code = _CODE_OF_DTYPE.get(np.dtype(dtype))
    if code is None:
        supported = sorted({str(d) for d in _CODE_OF_DTYPE})
        raise IndexedDatasetError(
            f"{path}: dtype {np.dtype(dtype)} cannot be stored in an mmap indexed dataset "
            f"(supported: {', '.join(supported)})")
    return code


def _write_error_message(path, error: OSError) -> str:
    """``cannot write PATH: CAUSE`` for an OSError met while writing ``path``: the file the system
    names (a temporary, a directory) or else ``path``, and the system's words for the cause."""
    where = error.filename if error.filename is not None else path
    cause = error.strerror or str(error)
    named = f"cannot write {path}" if os.fspath(where) == os.fspath(path) else f"cannot write {path} ({where})"
    return f"{named}: {cause}"


@contextlib.contextmanager
def _writing(path):
    """Turn an OSError of the enclosed writes (no space, read-only, no such directory) into an
    IndexedDatasetError naming ``path`` and the cause."""
    try:
        yield
    except OSError as error:
        raise IndexedDatasetError(_write_error_message(path, error)) from error


def make_output_directory(path, flag):
    """Create the directory ``path`` of an output (and its parents) if missing; IndexedDatasetError
    naming ``flag``, the directory and the cause when it cannot be (a file in the way, read-only)."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise IndexedDatasetError(f"{flag}: cannot create the directory {path}: a file of that name "
                                  f"exists") from None
    except OSError as error:
        where = error.filename if error.filename is not None else path
        raise IndexedDatasetError(f"{flag}: cannot create the directory {where}: "
                                  f"{error.strerror or error}") from None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_abandoned_temporaries(final_path) -> list[str]:
    """Delete the temporary files a killed writer of ``final_path`` left behind (``_temporary_path``
    names, whose process is gone); a live writer's are kept. Returns the paths removed."""
    directory, name = os.path.split(os.path.abspath(final_path))
    removed = []
    for entry in os.listdir(directory):
        parts = entry[len(name) + 2:].split(".") if entry.startswith(f".{name}.") else []
        if len(parts) == 3 and parts[2] == "tmp" and parts[0].isdigit() and not _process_alive(int(parts[0])):
            os.remove(os.path.join(directory, entry))
            removed.append(os.path.join(directory, entry))
    return removed


def _temporary_path(final_path):
    """A new empty file next to ``final_path`` whose name never looks like a finished dataset:
    ``.{name}.{pid}.{random}.tmp``, so that a later writer can tell a dead writer's leftovers.

    Created with the default permissions (umask applies), unlike ``tempfile.mkstemp``'s 0600.
    """
    remove_abandoned_temporaries(final_path)
    directory, name = os.path.split(os.path.abspath(final_path))
    while True:
        path = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            with open(path, "xb"):
                return path
        except FileExistsError:
            continue


def _flush_and_sync(file):
    file.flush()
    os.fsync(file.fileno())


def _write_index(path, dtype, sizes, doc_idx):
    """Write an ``.idx`` for items of ``sizes`` (int32) and ``doc_idx`` (int64) to ``path``."""
    sizes = np.asarray(sizes, dtype="<i4")
    doc_idx = np.asarray(doc_idx, dtype="<i8")
    pointers = np.zeros(len(sizes), dtype="<i8")
    if len(sizes) > 1:
        # Exclusive scan in int64: offsets past 2^31 bytes must not wrap.
        np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    with open(path, "wb") as index_file:
        index_file.write(_HEADER.pack(_MAGIC, _VERSION, dtype_code(dtype, path), len(sizes), len(doc_idx)))
        index_file.write(sizes.tobytes(order="C"))
        index_file.write(pointers.tobytes(order="C"))
        index_file.write(doc_idx.tobytes(order="C"))
        _flush_and_sync(index_file)


class IndexedDatasetBuilder:
    """Streaming writer of an mmap indexed dataset.

    Items are appended to a temporary file next to ``bin_path``; ``finalize(idx_path)`` writes the
    index under a temporary name, then renames the data to ``bin_path`` and the index to
    ``idx_path`` (last). ``abort()`` (or leaving a ``with`` block by an exception) deletes the
    temporary files. Items added after the last ``end_document()`` form the final document.
    """

    def __init__(self, bin_path, dtype=np.int64):
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype, bin_path)
        self._bin_path = bin_path
        with _writing(bin_path):
            self._tmp_bin_path = _temporary_path(bin_path)
            try:
                self._data_file = open(self._tmp_bin_path, "wb")
            except OSError:
                os.remove(self._tmp_bin_path)
                raise
        self._sizes = array.array("i")
        self._doc_idx = array.array("q", [0])
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._value_range = (int(info.min), int(info.max))
        else:
            self._value_range = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is not None:
            self.abort()

    def _as_array(self, tokens):
        """``tokens`` as a C-contiguous array of the dataset dtype, rejecting ids that would wrap."""
        values = np.asarray(tokens)
        if values.ndim != 1:
            raise IndexedDatasetError(f"{self._bin_path}: items must be 1-D, got shape {values.shape}")
        if self._value_range is not None and values.size and values.dtype != self.dtype:
            low, high = int(values.min()), int(values.max())
            if low < self._value_range[0] or high > self._value_range[1]:
                raise IndexedDatasetError(
                    f"{self._bin_path}: token id range [{low}, {high}] does not fit in {self.dtype}")
        return np.ascontiguousarray(values, dtype=self.dtype)

    def add_item(self, tokens):
        """Append one item (a 1-D sequence of token ids)."""
        values = self._as_array(tokens)
        self._append_sizes(np.array([values.size]))
        self._write(values)

    def _append_sizes(self, sizes):
        """Record item sizes (int32 in the index: an item holds fewer than 2^31 tokens)."""
        if len(sizes) and sizes.max() > np.iinfo(np.int32).max:
            raise IndexedDatasetError(
                f"{self._bin_path}: an item of {int(sizes.max())} tokens does not fit the int32 sizes")
        self._sizes.frombytes(sizes.astype(np.int32).tobytes())

    def end_document(self):
        """Close the current document: the items added since the previous call form one document."""
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens, lengths):
        """Append one document given as flat ``tokens`` split into items of ``lengths`` tokens."""
        values = self._as_array(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.sum() != values.size or (lengths < 0).any():
            raise IndexedDatasetError(
                f"{self._bin_path}: item lengths sum to {int(lengths.sum())} but the document has "
                f"{values.size} tokens")
        self._append_sizes(lengths)
        self._write(values)
        self.end_document()

    def add_documents(self, tokens, sizes, doc_item_counts):
        """Append many documents at once.

        ``tokens`` is the flat concatenation of all items, ``sizes[i]`` the length of item i and
        ``doc_item_counts[d]`` the number of items of document d (sum(doc_item_counts) = len(sizes)).
        Equivalent to add_item/end_document in a loop, without per-item Python work.
        """
        values = self._as_array(tokens)
        sizes = np.asarray(sizes, dtype=np.int64)
        doc_item_counts = np.asarray(doc_item_counts, dtype=np.int64)
        if (sizes.sum() != values.size or doc_item_counts.sum() != sizes.size
                or (sizes < 0).any() or (doc_item_counts < 0).any()):
            raise IndexedDatasetError(
                f"{self._bin_path}: {values.size} tokens, item sizes summing to {int(sizes.sum())}, "
                f"{sizes.size} items but document item counts summing to {int(doc_item_counts.sum())}")
        first_item = len(self._sizes)
        self._append_sizes(sizes)
        self._doc_idx.frombytes((first_item + np.cumsum(doc_item_counts)).tobytes())
        self._write(values)

    def _write(self, values):
        with _writing(self._bin_path):
            self._data_file.write(values.tobytes())

    def merge_file_(self, prefix):
        """Append every document of the dataset at ``prefix``, rebasing its indices (64-bit)."""
        other = MMapIndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"cannot merge {data_file_path(prefix)} (dtype {other.dtype}) into "
                f"{self._bin_path} (dtype {self.dtype}): dtypes differ")
        if self._doc_idx[-1] != len(self._sizes):
            raise IndexedDatasetError(
                f"{self._bin_path}: call end_document() before merging {prefix}: the open "
                f"document would absorb its first document")
        first_item = len(self._sizes)
        self._sizes.frombytes(np.asarray(other.sizes, dtype=np.int32).tobytes())
        self._doc_idx.frombytes((first_item + np.asarray(other.doc_idx[1:], dtype=np.int64)).tobytes())
        with open(data_file_path(prefix), "rb") as source, _writing(self._bin_path):
            shutil.copyfileobj(source, self._data_file, length=16 * 1024 * 1024)

    def finalize(self, idx_path):
        """Write the index and move both files to their final names (data first, index last)."""
        if self._doc_idx[-1] != len(self._sizes):
            self.end_document()
        try:
            with _writing(self._bin_path):
                _flush_and_sync(self._data_file)
                self._data_file.close()
            with _writing(idx_path):
                tmp_idx_path = _temporary_path(idx_path)
                try:
                    _write_index(tmp_idx_path, self.dtype, np.frombuffer(self._sizes, dtype=np.int32),
                                 np.frombuffer(self._doc_idx, dtype=np.int64))
                    # A stale index must never pair with the new data, even for an instant.
                    if os.path.exists(idx_path):
                        os.remove(idx_path)
                    os.replace(self._tmp_bin_path, self._bin_path)
                    os.replace(tmp_idx_path, idx_path)
                except BaseException:
                    _remove_quietly(tmp_idx_path)
                    raise
        except BaseException:
            self.abort()
            raise

    def abort(self):
        """Discard everything written so far (the temporary data file is deleted). Never raises an
        OSError: it runs while another error (a full disk, say) is being reported."""
        if not self._data_file.closed:
            try:
                self._data_file.close()  # flushes the buffer: fails again on a full disk
            except OSError:
                pass
        _remove_quietly(self._tmp_bin_path)


def _remove_quietly(path):
    """Delete ``path`` if it is there; a failure to delete is not reported (cleanup after an error)."""
    try:
        os.remove(path)
    except OSError:
        pass


class _Index:
    """Parsed, validated ``.idx``: memory-mapped ``sizes``, ``pointers`` and ``doc_idx``."""

    def __init__(self, path):
        if not os.path.isfile(path):
            raise IndexedDatasetError(f"{path}: index file not found")
        file_size = os.path.getsize(path)
        with open(path, "rb") as index_file:
            header = index_file.read(_HEADER.size)
        if len(header) < _HEADER.size:
            if not _MAGIC.startswith(header[: len(_MAGIC)]):
                raise IndexedDatasetError(f"{path}: not an mmap indexed dataset index (bad magic)")
            raise IndexedDatasetError(
                f"{path}: truncated index: {file_size} bytes, shorter than the {_HEADER.size}-byte header")
        magic, version, code, length, doc_count = _HEADER.unpack(header)
        self._check_header(path, magic, version, code)
        self.dtype = DTYPE_CODES[code]
        self.dtype_code = code
        expected_size = _HEADER.size + 12 * length + 8 * doc_count
        if file_size != expected_size:
            problem = "truncated index" if file_size < expected_size else "index has trailing bytes"
            raise IndexedDatasetError(
                f"{path}: {problem}: {file_size} bytes, but {length} items and {doc_count} document "
                f"offsets need {expected_size}")
        buffer = np.memmap(path, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(buffer, dtype="<i4", count=length, offset=_HEADER.size)
        self.pointers = np.frombuffer(buffer, dtype="<i8", count=length, offset=_HEADER.size + 4 * length)
        self.doc_idx = np.frombuffer(buffer, dtype="<i8", count=doc_count, offset=_HEADER.size + 12 * length)
        self._check_doc_idx(path, length)

    @staticmethod
    def _check_header(path, magic, version, code):
        if magic != _MAGIC:
            if magic.startswith(b"TNTIDX\x00\x00"):
                raise IndexedDatasetError(
                    f"{path}: this is the legacy lazy/cached (TNTIDX) format, which is not supported; "
                    f"re-run preprocessing with --dataset-impl mmap")
            raise IndexedDatasetError(
                f"{path}: not an mmap indexed dataset index (bad magic {magic!r}, expected {_MAGIC!r})")
        if version != _VERSION:
            raise IndexedDatasetError(f"{path}: unsupported index version {version} (expected {_VERSION})")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(
                f"{path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")

    def _check_doc_idx(self, path, length):
        doc_idx = self.doc_idx
        if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != length:
            first = int(doc_idx[0]) if len(doc_idx) else None
            last = int(doc_idx[-1]) if len(doc_idx) else None
            raise IndexedDatasetError(
                f"{path}: inconsistent document index: it must start at 0 and end at the item count "
                f"{length}, got first={first} last={last} ({len(doc_idx)} entries)")
        if len(doc_idx) > 1 and (np.diff(doc_idx) < 0).any():
            raise IndexedDatasetError(f"{path}: inconsistent document index: offsets decrease")


class MMapIndexedDataset:
    """Reader of an mmap indexed dataset at ``prefix`` (``prefix.bin`` + ``prefix.idx``).

    ``ds[i]`` is item i as a read-only array; ``ds.get(i, offset, length)`` is the sub-range
    ``ds[i][offset:offset+length]`` as a view into the mapped ``.bin`` (no copy). Opening checks the
    header, that the ``.idx`` size matches its counts, the document index, and that the ``.bin``
    holds exactly ``itemsize * sum(sizes)`` bytes. Pickles as its prefix (for DataLoader workers).
    """

    def __init__(self, path_prefix, skip_warmup=True):
        self._open(path_prefix, skip_warmup)

    def _check_pointers(self, index_path):
        """Every pointer is the running byte sum of the sizes before it (vectorised: a few milliseconds
        per million items), so no item is read from a shifted offset."""
        sizes, pointers = self._index.sizes, self._index.pointers
        if len(sizes) == 0:
            return
        expected = np.empty(len(sizes), dtype=np.int64)
        expected[0] = 0
        np.cumsum(sizes[:-1], dtype=np.int64, out=expected[1:])
        expected *= self.dtype.itemsize
        wrong = np.flatnonzero(pointers != expected)
        if len(wrong):
            item = int(wrong[0])
            raise IndexedDatasetError(f"{index_path}: pointers are inconsistent with item sizes: item {item} starts "
                                      f"at byte {int(pointers[item])}, its sizes put it at {int(expected[item])} "
                                      f"({len(wrong)} items misplaced)")

    def _open(self, path_prefix, skip_warmup):
        self._path_prefix = path_prefix
        self._skip_warmup = skip_warmup
        index_path = index_file_path(path_prefix)
        bin_path = data_file_path(path_prefix)
        self._index = _Index(index_path)
        if not os.path.isfile(bin_path):
            raise IndexedDatasetError(f"{bin_path}: data file not found (index {index_path} exists)")
        sizes = self._index.sizes
        negative = np.flatnonzero(sizes < 0)
        if len(negative):
            raise IndexedDatasetError(
                f"{index_path}: item {int(negative[0])} has a negative size {int(sizes[negative[0]])}")
        expected_bytes = int(sizes.sum(dtype=np.int64)) * self.dtype.itemsize
        actual_bytes = os.path.getsize(bin_path)
        if actual_bytes != expected_bytes:
            raise IndexedDatasetError(
                f"{bin_path}: data file has {actual_bytes} bytes but {index_path} describes "
                f"{expected_bytes} ({int(sizes.sum(dtype=np.int64))} tokens of {self.dtype})")
        self._check_pointers(index_path)
        if not skip_warmup:
            _warmup(index_path)
            _warmup(bin_path)
        if actual_bytes:
            self._bin_buffer = memoryview(np.memmap(bin_path, mode="r", dtype=np.uint8))
        else:
            self._bin_buffer = memoryview(b"")

    def __getstate__(self):
        return {"path_prefix": self._path_prefix, "skip_warmup": self._skip_warmup}

    def __setstate__(self, state):
        self._open(state["path_prefix"], True)

    def __len__(self):
        return len(self._index.sizes)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.get(idx)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise IndexError(f"{self._path_prefix}: slices must have step 1, got {step}")
            return [self.get(i) for i in range(start, stop)]
        raise TypeError(f"{self._path_prefix}: index must be an int or a slice, got {type(idx).__name__}")

    def get(self, idx, offset=0, length=None):
        """Tokens ``offset:offset+length`` of item ``idx`` as a read-only view into the ``.bin``."""
        count = len(self)
        if idx < 0:
            idx += count
        if not 0 <= idx < count:
            raise IndexError(f"{self._path_prefix}: item {idx} out of range for {count} items")
        size = int(self._index.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"{self._path_prefix}: range offset={offset} length={length} outside item {idx} of {size} tokens")
        start = int(self._index.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=length, offset=start)

    @property
    def sizes(self):
        """Tokens per item, int32 [len]."""
        return self._index.sizes

    @property
    def pointers(self):
        """Byte offset of each item in the ``.bin``, int64 [len]."""
        return self._index.pointers

    @property
    def doc_idx(self):
        """Item index where each document starts, int64 [documents + 1]."""
        return self._index.doc_idx

    @property
    def dtype(self):
        return self._index.dtype

    @property
    def dtype_code(self):
        """The .idx dtype code the dtype was read from (DTYPE_CODES)."""
        return self._index.dtype_code

    @property
    def path_prefix(self):
        return self._path_prefix

    @staticmethod
    def exists(path_prefix):
        """Whether both files of ``path_prefix`` exist (does not validate them)."""
        return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(data_file_path(path_prefix))


def _warmup(path):
    """Read ``path`` once so the first training steps do not page it in piecemeal."""
    with open(path, "rb") as file:
        while file.read(_WARMUP_CHUNK_BYTES):
            pass


def infer_dataset_impl(path_prefix):
    """``"mmap"`` or ``"legacy"`` from the magic of ``path_prefix.idx``; error if neither."""
    path = index_file_path(path_prefix)
    if not os.path.isfile(path):
        raise IndexedDatasetError(f"{path}: index file not found")
    with open(path, "rb") as index_file:
        magic = index_file.read(len(_MAGIC))
    if magic == _MAGIC:
        return "mmap"
    if magic.startswith(b"TNTIDX\x00\x00"):
        return "legacy"
    raise IndexedDatasetError(f"{path}: not an indexed dataset index (bad magic {magic!r})")


def make_dataset(path_prefix, impl="mmap", skip_warmup=True):
    """Open the dataset at ``path_prefix``; ``impl`` is ``mmap`` or ``infer``.

    The legacy ``lazy``/``cached`` (TNTIDX) formats are not supported: they raise an error asking
    to re-run preprocessing with ``--dataset-impl mmap``.
    """
    if impl in ("lazy", "cached"):
        raise IndexedDatasetError(
            f"{path_prefix}: dataset impl '{impl}' (the legacy TNTIDX format) is not supported; "
            f"re-run preprocessing with --dataset-impl mmap and use --data-impl mmap")
    if impl == "infer":
        impl = infer_dataset_impl(path_prefix)
        if impl == "legacy":
            raise IndexedDatasetError(
                f"{index_file_path(path_prefix)}: the legacy lazy/cached (TNTIDX) format is not "
                f"supported; re-run preprocessing with --dataset-impl mmap")
    if impl != "mmap":
        raise IndexedDatasetError(f"{path_prefix}: unknown dataset impl '{impl}' (use mmap or infer)")
    return MMapIndexedDataset(path_prefix, skip_warmup=skip_warmup)


def _missing_dataset_hint(prefix: str) -> str:
    """Why ``prefix`` names no dataset, with the likely prefix: a path given with its .bin/.idx
    extension, or without the ``_{key}_document`` suffix that preprocessing appends."""
    stem, extension = os.path.splitext(prefix)
    if extension in (".bin", ".idx") and os.path.isfile(index_file_path(stem)):
        return f"give the prefix without the {extension} extension: {stem}"
    directory = os.path.dirname(prefix) or "."
    if not os.path.isdir(directory):
        return f"the directory {directory} does not exist"
    name = os.path.basename(stem if extension in (".bin", ".idx") else prefix)
    candidates = sorted(entry[:-len(".idx")] for entry in os.listdir(directory)
                        if entry.endswith(".idx") and entry.startswith(name))
    if candidates:
        shown = ", ".join(os.path.join(directory, entry) for entry in candidates[:4])
        return (f"the prefix is the --output-prefix of preprocessing plus _<json key>_document, e.g. "
                f"{prefix}_text_document; datasets starting with this name: {shown}")
    return f"no {name}*.idx in {directory}"


def check_dataset_prefix(prefix: str, impl: str = "infer", vocab_size: int | None = None) -> None:
    """Open the dataset at ``prefix`` once, as training will (header, counts, document index and the
    .bin size are checked), and close it; no dataset there raises IndexedDatasetError with a hint.
    Given the tokenizer's ``vocab_size``, its dtype and a sample of its ids are checked against the
    vocabulary too (check_vocabulary)."""
    if not (os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))):
        present = [path for path in (index_file_path(prefix), data_file_path(prefix)) if os.path.isfile(path)]
        found = f" (only {present[0]} exists)" if present else ""
        raise IndexedDatasetError(f"{prefix}: no dataset at this prefix{found}; {_missing_dataset_hint(prefix)}")
    dataset = make_dataset(prefix, impl)
    if vocab_size is not None:
        check_vocabulary(dataset, vocab_size)


_WRONG_DATA_HINT = ("the data was tokenized with another tokenizer (preprocessing stores uint16 ids below 65500 "
                    "tokens, int32 above), or the .idx dtype code is wrong")


def check_vocabulary(dataset: MMapIndexedDataset, vocab_size: int) -> None:
    """Check that ``dataset`` holds ids of a tokenizer of ``vocab_size`` tokens; IndexedDatasetError
    naming the file otherwise.

    1. The dtype is an integer type whose range covers [0, vocab_size): a float, or int16 for a
       50257-token vocabulary, means a changed .idx dtype code or another tokenizer's data.
       (A wider dtype than preprocessing would pick, e.g. int32 for 50257 tokens, is valid.)
    2. A sample of ids lies in [0, vocab_size): the first 16 ids of up to 256 items spread evenly
       over the dataset, first and last included; about 4k ids from 256 pages, milliseconds
       whatever the dataset's size. A wrong tokenizer or dtype code puts ids out of range nearly
       everywhere; a bad id the sample misses is reported, naming the file, when GPTDataset reads it.
    """
    index_path, bin_path = index_file_path(dataset.path_prefix), data_file_path(dataset.path_prefix)
    dtype = dataset.dtype
    if dtype.kind not in "iu" or np.iinfo(dtype).max < vocab_size - 1:
        holds = "is not an integer type" if dtype.kind not in "iu" else f"holds ids up to {np.iinfo(dtype).max}"
        raise IndexedDatasetError(
            f"{index_path}: tokens are stored as {dtype} (dtype code {dataset.dtype_code}), which {holds}, but the "
            f"tokenizer has {vocab_size} tokens: {_WRONG_DATA_HINT}")
    items, ids = _sampled_ids(dataset)
    outside = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if len(outside):
        first = int(outside[0])
        raise IndexedDatasetError(
            f"{bin_path}: token id {int(ids[first])} (item {int(items[first])}) is outside the tokenizer's "
            f"vocabulary [0, {vocab_size}) (sampled across the file: {len(ids)} ids in [{int(ids.min())}, "
            f"{int(ids.max())}] as {dtype}, {len(outside)} of them outside): {_WRONG_DATA_HINT}")


def _sampled_ids(dataset: MMapIndexedDataset):
    """(item of each id, ids) of the open-time sample: up to _SAMPLED_TOKENS_PER_ITEM ids from the start of
    up to _SAMPLED_ITEMS items spread evenly over the dataset (only their sizes and pointers are read)."""
    sizes = dataset.sizes
    if len(sizes) == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=dataset.dtype)
    items = np.unique(np.linspace(0, len(sizes) - 1, min(len(sizes), _SAMPLED_ITEMS)).astype(np.int64))
    offsets = np.arange(_SAMPLED_TOKENS_PER_ITEM, dtype=np.int64)
    keep = offsets[None, :] < sizes[items][:, None]  # [items, tokens]
    positions = dataset.pointers[items][:, None] // dataset.dtype.itemsize + offsets[None, :]
    tokens = np.frombuffer(dataset._bin_buffer, dtype=dataset.dtype)
    return np.broadcast_to(items[:, None], keep.shape)[keep], tokens[positions[keep]]
