"""Known datasets: read from ``$AIAYN_DATA_DIR/<folder>/`` or downloaded once, sha256-checked.

Lookup order for ``dataset_path(name, filename)``:

1. ``$AIAYN_DATA_DIR`` set: the file must be in ``$AIAYN_DATA_DIR/<folder>/`` (offline machines);
   a missing file is an error rather than a silent download attempt.
2. Otherwise ``$AIAYN_CACHE_DIR/<folder>/`` (default ``~/.cache/aiayn``), downloading it from
   its public source on first use: to a temporary file in the same folder, checked against the
   sha256 below, then renamed, so a cache never holds a partial or wrong file (concurrent
   processes, such as DDP ranks, each rename a complete copy).

Every file, local or downloaded, is checked against its sha256: a truncated or different copy
would otherwise train silently on other data than the recipe promises.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import atomic_write, atomic_write_json, cache_dir, sha256_file
from .corpus import DataError, iter_parallel, read_jsonl_rows, read_parallel, read_text

DATA_DIR_ENV = "AIAYN_DATA_DIR"
DOWNLOAD_TIMEOUT_S = 60


@dataclass(frozen=True)
class RemoteFile:
    url: str
    sha256: str


@dataclass(frozen=True)
class Dataset:
    folder: str  # sub-folder of the data / cache directory
    files: dict[str, RemoteFile]


_M30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
_M30K_SHA256 = {
    "test_2016_flickr.cs.gz": "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
    "test_2017_flickr.de.gz": "a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee",
    "test_2017_flickr.en.gz": "76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074",
    "test_2017_flickr.fr.gz": "3ba671ceb2299f3304ffafefea7a833d08632fbaf0ba18546f8a2ec2391af496",
    "test_2017_mscoco.de.gz": "799e4854c25d601cb6cb6be29eabe5667734c61ace2f495e03e429031a0bc338",
    "test_2017_mscoco.en.gz": "aab300bfb4427697987e02cd0aacd44bfe8aa50456231b6474c08038bbed2b58",
    "test_2017_mscoco.fr.gz": "754f3072ba9f124569ba5258b32730fc1d214bbf8e0c6dfb2b74401676220db0",
    "train.cs.gz": "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "val.cs.gz": "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
}

DATASETS: dict[str, Dataset] = {
    # Multi30k task 1 (WMT16 multimodal MT), raw: cased, untokenized.
    "multi30k": Dataset("multi30k", {f: RemoteFile(_M30K_URL + f, h) for f, h in _M30K_SHA256.items()}),
    "tinyshakespeare": Dataset(
        "tinyshakespeare",
        {
            "input.txt": RemoteFile(
                "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
                "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
            )
        },
    ),
    # 1,000 XSum rows {document, summary, id}.
    "xsum": Dataset(
        "xsum-sample",
        {
            "xsum-1000.jsonl": RemoteFile(
                "https://raw.githubusercontent.com/voidism/Lookback-Lens/main/data/xsum-1000.jsonl",
                "71409a4cbe21b183ccd44e317bf7a42522bb0db37bc754f89ce20260d0c0ab9b",
            )
        },
    ),
}

# WMT 2014 English-German training data as the paper used it (4.5M pairs): Europarl v7, Common Crawl and News
# Commentary v9 (the German-English files of each tarball); sha256 and sizes as published with TensorFlow
# Datasets' checksums of the same URLs. Validation (newstest2013) and test (newstest2014, the full 3,003
# sentences) come through sacreBLEU, which downloads and checks its test sets itself.
_WMT14_TRAIN = (  # (tarball, sha256, bytes, path of the de-en pair inside it without the language suffix)
    ("https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz",
     "0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7", 657_632_379, "training/europarl-v7.de-en"),
    ("https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz",
     "c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5", 918_311_367, "commoncrawl.de-en"),
    ("https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz",
     "cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485", 80_418_416,
     "training/news-commentary-v9.de-en"),
)
DATASETS["wmt14"] = Dataset("wmt14", {url.rsplit("/", 1)[1]: RemoteFile(url, sha) for url, sha, _, _ in _WMT14_TRAIN})
# sacreBLEU's names of the splits that are not training data
WMT14_TEST_SETS = {"valid": "wmt13", "newstest2013": "wmt13", "test": "wmt14/full", "newstest2014": "wmt14/full"}

MULTI30K_SPLITS = ("train", "val", "test_2016_flickr", "test_2017_flickr", "test_2017_mscoco")



HASH_CACHE = "hashes.json"
RACY_NS = 100_000_000  # a change this close to a hash may share the file's ctime tick (coarse clocks): not trusted


def sha256_known(path: str | Path) -> str:
    """sha256 of a corpus file, remembered in ``cache_dir()/hashes.json`` (``$AIAYN_CACHE_DIR``, default
    ``~/.cache/aiayn``) with the file's size, modification and change times (ns) and inode: a training that starts
    again from a prepared store does not read gigabytes of unchanged text to learn that it is unchanged. Any
    difference hashes the file again. The change time (ctime) is set by the kernel at every write and cannot be
    set back, so an edit that restores the modification time is still seen; an entry recorded within
    :data:`RACY_NS` of the file's last change is not trusted (a later write could fall in the same clock tick),
    as git treats its "racily clean" entries. An unwritable cache only costs the hashing."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}
    book = cache_dir() / HASH_CACHE
    try:
        known = json.loads(book.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    entry = known.get(str(path)) if isinstance(known, dict) else None
    if (isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items())
            and entry.get("hashed_ns", 0) - st.st_ctime_ns > RACY_NS):
        return str(entry["sha256"])
    hashed_ns = time.time_ns()  # taken before reading: a write during the hashing makes the entry racy
    digest = sha256_file(path)
    known = {k: v for k, v in known.items() if os.path.exists(k)} if isinstance(known, dict) else {}  # no stale
    known[str(path)] = {**stamp, "hashed_ns": hashed_ns, "sha256": digest}
    try:
        book.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(book, known)
    except OSError:
        pass
    return digest


def fetch(url: str, dest: Path) -> None:
    """Copy ``url`` (https://, file://) to ``dest``. Module-level so tests can replace it."""
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as r, open(dest, "wb") as f:
        shutil.copyfileobj(r, f)


def dataset_path(name: str, filename: str) -> Path:
    """Local path of a known dataset file, from ``$AIAYN_DATA_DIR`` or the (downloading) cache."""
    remote = _remote(name, filename)
    folder = DATASETS[name].folder
    data_dir = os.environ.get(DATA_DIR_ENV)
    if data_dir:
        path = Path(data_dir).expanduser() / folder / filename
        if not path.is_file():
            raise DataError(
                f"{path}: no such file ({DATA_DIR_ENV} is set, so {name} is read from there; "
                f"unset it to download from {remote.url})"
            )
        _verify(path, remote, delete=False)
        return path
    path = cache_dir() / folder / filename
    if path.is_file():
        if sha256_file(path) == remote.sha256:
            return path
        path.unlink()  # a corrupted cache entry: fetch it again
    _download(remote, path)
    return path


def _remote(name: str, filename: str) -> RemoteFile:
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r} (known: {', '.join(sorted(DATASETS))})")
    files = DATASETS[name].files
    if filename not in files:
        raise DataError(f"dataset {name} has no file {filename!r} (files: {', '.join(sorted(files))})")
    return files[filename]


def _verify(path: Path, remote: RemoteFile, delete: bool) -> None:
    got = sha256_file(path)
    if got != remote.sha256:
        if delete:
            path.unlink(missing_ok=True)
        what = "the download was deleted" if delete else "replace it with the file from " + remote.url
        raise DataError(f"{path}: sha256 mismatch (expected {remote.sha256}, got {got}); {what}")


def _download(remote: RemoteFile, path: Path) -> None:
    """Fetch ``remote`` into ``path`` atomically; a failed download or a wrong sha256 leaves nothing behind."""

    def write(tmp: str) -> None:
        try:
            fetch(remote.url, Path(tmp))
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            raise DataError(
                f"cannot download {remote.url} ({reason}); to work offline, put the file in "
                f"${DATA_DIR_ENV}/{path.parent.name}/{path.name}"
            ) from None
        got = sha256_file(tmp)
        if got != remote.sha256:
            raise DataError(
                f"{remote.url}: sha256 mismatch (expected {remote.sha256}, got {got}); the download was deleted"
            )

    atomic_write(path, write)


def multi30k_split(split: str, src_lang: str = "en", tgt_lang: str = "de") -> list[tuple[str, str]]:
    """Sentence pairs of a Multi30k split: train, val, test_2016_flickr, test_2017_flickr, test_2017_mscoco."""
    files = DATASETS["multi30k"].files
    if split not in MULTI30K_SPLITS:
        raise DataError(f"multi30k has no split {split!r} (splits: {', '.join(MULTI30K_SPLITS)})")
    langs = sorted(f.split(".")[1] for f in files if f.split(".")[0] == split)
    for lang in (src_lang, tgt_lang):
        if lang not in langs:
            raise DataError(f"multi30k {split} has no language {lang!r} (languages: {', '.join(langs)})")
    return read_parallel(
        dataset_path("multi30k", f"{split}.{src_lang}.gz"), dataset_path("multi30k", f"{split}.{tgt_lang}.gz")
    )


def _wmt14_langs(src_lang: str, tgt_lang: str) -> None:
    if {src_lang, tgt_lang} != {"en", "de"}:
        raise DataError(f"wmt14 is the English-German task: src_lang/tgt_lang must be en and de, got "
                        f"{src_lang}/{tgt_lang}")


def wmt14_train_files(src_lang: str = "en", tgt_lang: str = "de") -> list[tuple[Path, Path]]:
    """The (source file, target file) of each WMT14 En-De training corpus, plain text extracted once from its
    sha256-checked tarball into ``$AIAYN_CACHE_DIR/wmt14/extracted`` (never into a read-only data dir)."""
    import tarfile

    _wmt14_langs(src_lang, tgt_lang)
    out_dir = cache_dir() / DATASETS["wmt14"].folder / "extracted"
    files = []
    for url, sha, _, member in _WMT14_TRAIN:
        name = url.rsplit("/", 1)[1]
        stem = member.rsplit("/", 1)[-1]
        done = out_dir / f"{stem}.json"  # written last: the extraction of this archive is complete
        paths = {lang: out_dir / f"{stem}.{lang}" for lang in ("en", "de")}
        record = None
        if done.is_file():
            record = json.loads(done.read_text(encoding="utf-8"))
        if not (record and record.get("sha256") == sha and all(
                paths[lang].is_file() and paths[lang].stat().st_size == record["bytes"][lang] for lang in paths)):
            archive = dataset_path("wmt14", name)  # downloaded (or found) and checked
            out_dir.mkdir(parents=True, exist_ok=True)
            sizes = {}
            with tarfile.open(archive, "r:gz") as tar:
                for lang, path in paths.items():
                    try:
                        info = tar.getmember(f"{member}.{lang}")
                    except KeyError:
                        raise DataError(f"{archive}: no member {member}.{lang}") from None
                    atomic_write(path, lambda tmp, i=info: _copy_member(tar, i, tmp))
                    sizes[lang] = info.size
            atomic_write_json(done, {"archive": name, "sha256": sha, "bytes": sizes})
        files.append((paths[src_lang], paths[tgt_lang]))
    return files


def _copy_member(tar: Any, info: Any, dest: str) -> None:
    with tar.extractfile(info) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)


def wmt14_train_pairs(src_lang: str = "en", tgt_lang: str = "de") -> Iterator[tuple[str, str]]:
    """The 4.5M WMT14 En-De training pairs, streamed corpus by corpus (never held in memory)."""
    for src, tgt in wmt14_train_files(src_lang, tgt_lang):
        yield from iter_parallel(src, tgt)


def wmt14_split(split: str, src_lang: str = "en", tgt_lang: str = "de") -> list[tuple[str, str]]:
    """Pairs of a WMT14 En-De test set through sacreBLEU: valid / newstest2013, test / newstest2014 (full)."""
    _wmt14_langs(src_lang, tgt_lang)
    if split not in WMT14_TEST_SETS:
        raise DataError(f"wmt14 has no split {split!r} here (splits: train, {', '.join(WMT14_TEST_SETS)})")
    from sacrebleu.utils import get_reference_files, get_source_file

    name, pair = WMT14_TEST_SETS[split], f"{src_lang}-{tgt_lang}"
    try:
        src, (ref, *_) = get_source_file(name, pair), get_reference_files(name, pair)
    except Exception as e:  # sacreBLEU raises bare Exceptions and exits on download errors
        raise DataError(f"sacreBLEU could not give {name} {pair}: {e}") from None
    return read_parallel(src, ref)


def tinyshakespeare_text() -> str:
    """The 1,115,394 characters of tinyshakespeare (the char-rnn LM benchmark)."""
    return read_text(dataset_path("tinyshakespeare", "input.txt"))


def xsum_rows() -> list[dict[str, Any]]:
    """1,000 XSum rows ``{"document", "summary", "id"}``."""
    return read_jsonl_rows(dataset_path("xsum", "xsum-1000.jsonl"))


def xsum_sha256() -> str:
    """The published sha256 of the XSum sample: what a store of its pairs is keyed by."""
    return DATASETS["xsum"].files["xsum-1000.jsonl"].sha256
