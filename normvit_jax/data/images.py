"""The rule that turns any decodable image file or array into RGB uint8 (docs/data.md: "RGB rule").

Files are opened with PIL (JPEG, PNG, BMP, GIF, WebP, TIFF, ...):
1. EXIF orientation is applied (the pixels are turned as a viewer shows them).
2. Animated files (GIF, WebP, APNG): the first frame.
3. Modes: RGB as is; L / 1 / LA / P / PA / RGBA / CMYK / YCbCr / LAB / HSV through PIL's
   ``convert('RGB')``: gray is copied to the three channels, a palette is looked up, alpha is
   dropped (not composited: the colour under a transparent pixel is kept, as torchvision's and
   timm's ``ImageFolder`` loaders and TF's ``decode_image(channels=3)`` do), CMYK is converted by
   PIL's formula (no ICC profile). 16-bit gray (I;16*, I) images are scaled by 255/65535 and
   rounded; 16-bit RGB(A) PNGs keep each value's high byte (PIL and TensorFlow alike); 32-bit
   float (F) images are clipped to [0, 255] by PIL.
Arrays: uint8 as is; other integer types must lie in [0, 255] (uint16: scaled like 16-bit files);
float must lie in [0, 1] and becomes round(x * 255). One channel is copied to three; a fourth
(alpha) channel is dropped.

What is stored: JPEG (MPO too) and PNG files that need no change (RGB or gray, 8-bit, upright, no
alpha or palette; a PNG with its last chunk) keep their original bytes (no re-compression); every
other image is stored as the PNG of its RGB pixels (lossless).
"""
from __future__ import annotations

import contextlib
import io
import re
import threading
from typing import Any, Iterator

import numpy as np

# What TF's decode_image and tfds's readers decode as stored. MPO is PIL's name for a JPEG with
# more images after the photo (an MPF preview or depth map: many cameras' and phones' .jpg files);
# every decoder reads its first image, the photo, and it was re-encoded as a PNG 3-5x its size.
KEEP_FORMATS = ("JPEG", "MPO", "PNG")
_KEEP_MODES = ("RGB", "L")


class BadImageError(Exception):
    """A file PIL cannot decode (corrupt, truncated, empty, not an image)."""


# The largest image prepare and predict decode (serve's is its --max_pixels, 50 MP): a 200 MP
# phone photo (16320x12240) is under it; PIL's own default (179 MP) refused it as a "decompression
# bomb DOS attack". An image over it is refused from its header, named by its size. Each image
# over BIG_PIXELS decodes alone (BIG_LOCK): 200 MP is 600 MB of RGB, held 2-3 times while decoded.
MAX_FILE_PIXELS = 250_000_000
BIG_PIXELS = 50_000_000
BIG_LOCK = threading.Lock()
_PIL_LIMIT_SET = []


def _pil():
    from PIL import Image, ImageOps
    if not _PIL_LIMIT_SET:  # once: PIL warns over this and refuses over twice this, unread
        Image.MAX_IMAGE_PIXELS = MAX_FILE_PIXELS
        _PIL_LIMIT_SET.append(True)
    return Image, ImageOps


def _too_large(w: int, h: int) -> BadImageError:
    return BadImageError(f"an image of {w}x{h} = {w * h / 1e6:.0f} megapixels, over the limit of "
                         f"{MAX_FILE_PIXELS / 1e6:.0f} megapixels that prepare and predict decode "
                         "(a decompression bomb, or a photo to scale down first)")


def _check_size(im) -> None:
    w, h = im.size
    if w * h > MAX_FILE_PIXELS:
        raise _too_large(w, h)


def _bomb(e: Exception) -> BadImageError:
    """PIL's DecompressionBombError (over twice MAX_FILE_PIXELS) named as _too_large names it."""
    m = re.search(r"\((\d+) pixels\)", str(e))
    return BadImageError(f"an image of {int(m.group(1)) / 1e6:.0f} megapixels, over the limit of "
                         f"{MAX_FILE_PIXELS / 1e6:.0f} megapixels that prepare and predict decode "
                         "(a decompression bomb, or a photo to scale down first)" if m else
                         f"over the limit of {MAX_FILE_PIXELS / 1e6:.0f} megapixels ({e})")


def to_rgb(im: Any) -> np.ndarray:
    """A PIL image (already oriented, first frame) -> uint8 (H, W, 3) by the rule above."""
    if im.mode.startswith("I;16") or im.mode == "I":
        a = np.asarray(im, np.float64)
        a = np.clip(np.rint(a * (255.0 / 65535.0)), 0, 255).astype(np.uint8)
        return np.repeat(a[..., None], 3, axis=-1)
    if im.mode != "RGB":
        im = im.convert("RGB")
    return np.asarray(im, np.uint8)


# A PNG's last chunk. PIL decodes a PNG cut short after its image data (a copy or download
# stopped in the last bytes) and TensorFlow's decoder, training's, does not: such a file kept as it
# was stopped the training run that met it ("example k of the split cannot be decoded").
_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"


# TIFF tag NewSubfileType; bit 0 marks a reduced-resolution image. A camera RAW file (Nikon .NEF,
# .DNG) is a TIFF whose first image is such a preview (160x120 in a .NEF): PIL opened it, and a
# RAW + JPEG folder gave each photo a second, thumbnail-sized copy in the class.
_NEW_SUBFILE_TYPE = 254


def _turned(orientation: Any) -> bool:
    """Whether an EXIF Orientation value turns or flips the image: 2..8. Others are upright, as
    for exif_transpose (0 or 65535, written by some cameras and apps, made such a JPEG a PNG 3-5x
    its size, which training decoded whole instead of its crop window)."""
    return orientation in range(2, 9)


def _kept(im, fmt: str | None, orientation: Any, data: bytes) -> bool:
    """Whether an opened image is stored (and decoded by TF) as its original bytes."""
    return (fmt in KEEP_FORMATS and im.mode in _KEEP_MODES and not _turned(orientation)
            and "transparency" not in im.info and (fmt != "PNG" or _PNG_END in data))


# ISO-BMFF brands of HEIC/HEIF files (iPhone photos since iOS 11), which PIL does not decode
_HEIF_BRANDS = (b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1")


def _unrecognised(data: bytes) -> BadImageError:
    """Why PIL recognises no image in ``data``; a HEIC photo is named as such, with what to do."""
    if data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS:
        return BadImageError("a HEIC/HEIF photo, which PIL cannot decode; convert it to JPEG "
                             "(macOS: sips -s format jpeg IMG.HEIC --out IMG.jpg)")
    return BadImageError("not an image format PIL recognises")


# Video containers found among photos (a phone's camera roll, a Takeout export): named from their
# first bytes, so that the rest, gigabytes, is never read (each was read whole into memory, one
# per decode thread, only for PIL to say it is no image)
_VIDEO_BOXES = (b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot")  # QuickTime without ftyp


def video_kind(head: bytes) -> str | None:
    """'MP4/MOV', 'AVI', ... if ``head`` (a file's first bytes, 512 or more) starts a video."""
    if head[4:8] == b"ftyp":  # ISO-BMFF: videos, and HEIC, AVIF, Canon .CR3 (left to PIL)
        not_video = _HEIF_BRANDS + (b"avif", b"avis", b"crx ")
        return None if head[8:12] in not_video else "MP4/MOV"
    if head[4:8] in _VIDEO_BOXES:
        return "MOV"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "AVI"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "MKV/WebM"
    if head[:4] == b"\x00\x00\x01\xba" or head[:4] == b"\x00\x00\x01\xb3":
        return "MPEG"
    if any(head[k:k + 565:188] == b"GGG" for k in (0, 4)):  # 3 sync bytes; GIF starts with 'G'
        return "MPEG-TS (.MTS)"
    if head[:3] == b"FLV" or head[:4] == b"\x30\x26\xb2\x75":
        return "FLV/WMV"
    return None


HEAD_BYTES = 4096


def read_file(path: str) -> bytes:
    """The bytes of the image file ``path``; a video is refused (BadImageError) from its first
    HEAD_BYTES, the rest not read. OSError passes through."""
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
        kind = video_kind(head)
        if kind:
            raise BadImageError(f"a video ({kind}), not an image")
        return head + f.read()


@contextlib.contextmanager
def _pil_errors(data: bytes) -> Iterator[None]:
    """Reading ``data`` with PIL inside the block: its errors become BadImageError (a
    decompression bomb by its size, an unrecognised file by what it looks like, any other error
    by its type and message); stored_as_is's and load_file's."""
    Image, _ = _pil()
    try:
        yield
    except BadImageError:
        raise
    except Image.DecompressionBombError as e:
        raise _bomb(e) from None
    except Image.UnidentifiedImageError:
        raise _unrecognised(data) from None
    except Exception as e:  # noqa: BLE001  (PIL raises many types for bad headers)
        raise BadImageError(f"{type(e).__name__}: {e}") from None


def stored_as_is(data: bytes) -> bool:
    """Whether ``load_file`` would keep ``data`` as it is, from the file's header only (nothing is
    decoded: predict lets TensorFlow's decoder, evaluation's, decode such a file once).
    Raises BadImageError for an empty file or one PIL does not recognise."""
    Image, _ = _pil()
    if not data:
        raise BadImageError("empty file (0 bytes)")
    with _pil_errors(data):
        im = Image.open(io.BytesIO(data))
        _check_size(im)
        return _kept(im, im.format, im.getexif().get(0x0112, 1), data)


# Why a file PIL decodes is refused: TensorFlow's decoder, which training and evaluation use, does
# not decode it (a PNG with a damaged chunk CRC, an unknown critical chunk, two IHDR chunks, cut
# before its end). predict, serve and prepare name it so.
TF_UNDECODABLE = ("TensorFlow's decoder, which evaluation uses, cannot decode it (PIL can: the "
                  "file may be damaged or cut short)")


def load_file(data: bytes, check_tf: bool = False) -> tuple[bytes, np.ndarray]:
    """Encoded file bytes -> (bytes to store, uint8 (H, W, 3) pixels). Raises BadImageError.
    ``check_tf`` (prepare): a PNG stored as it is must also be decoded by TensorFlow's decoder,
    training's (PIL is laxer: it reads PNGs with a damaged CRC or an unknown critical chunk); one
    that is not raises BadImageError(TF_UNDECODABLE). JPEGs are not checked: both decoders are
    libjpeg-turbo, they agreed on 600 damaged JPEGs, and the check nearly doubled prepare's decode
    time; files re-encoded here need no check."""
    Image, ImageOps = _pil()
    if not data:
        raise BadImageError("empty file (0 bytes)")
    with _pil_errors(data):
        im = Image.open(io.BytesIO(data))
        _check_size(im)
    big = im.size[0] * im.size[1] > BIG_PIXELS
    with BIG_LOCK if big else contextlib.nullcontext():
        return _decode(im, data, check_tf)


def _decode(im, data: bytes, check_tf: bool) -> tuple[bytes, np.ndarray]:
    """load_file's decode of the opened image ``im`` of ``data``."""
    Image, ImageOps = _pil()
    try:
        fmt = im.format
        im.seek(0)
        if fmt == "TIFF" and int(im.tag_v2.get(_NEW_SUBFILE_TYPE, 0)) & 1:
            raise BadImageError(
                f"its first image is a {im.size[0]}x{im.size[1]} preview (a camera RAW file: "
                ".NEF, .DNG, ...), and PIL cannot decode the photo; convert it to JPEG or TIFF")
        orientation = im.getexif().get(0x0112, 1)  # EXIF Orientation tag; 1 is upright
        im.load()  # decodes fully: a truncated file fails here
        if _turned(orientation):
            im = ImageOps.exif_transpose(im)
        keep = _kept(im, fmt, orientation, data)
        rgb = to_rgb(im)
    except BadImageError:
        raise
    except Image.UnidentifiedImageError:
        raise _unrecognised(data) from None
    except Exception as e:  # noqa: BLE001  (PIL raises many types for bad files)
        raise BadImageError(f"{type(e).__name__}: {e}") from None
    if rgb.ndim != 3 or rgb.shape[0] < 1 or rgb.shape[1] < 1:
        raise BadImageError(f"decoded to an empty image {rgb.shape}")
    if keep and check_tf and data[:8] == b"\x89PNG\r\n\x1a\n":
        from normvit_jax.data import tf_images
        if tf_images.decode_error(data) is not None:
            raise BadImageError(TF_UNDECODABLE)
    return (data if keep else encode_png(rgb)), rgb


def as_stored(data: bytes) -> bytes:
    """The bytes evaluation decodes for a file (prepare's rule): the file as it is where
    ``stored_as_is`` (its header only: TensorFlow's decoder decodes it, once), else the PNG of its
    RGB pixels. Raises BadImageError. predict and serve make their input with it."""
    return data if stored_as_is(data) else load_file(data)[0]


def undecodable(data: bytes) -> str:
    """Why TensorFlow's decoder (evaluation's) could not decode a file whose header was read:
    PIL's reason when PIL fails too (a truncated JPEG), else what differs (a PNG cut just before
    its end, which PIL reads)."""
    try:
        load_file(data)
    except BadImageError as e:
        return str(e)
    return TF_UNDECODABLE


def encode_png(rgb: np.ndarray) -> bytes:
    """uint8 (H, W, 3) -> PNG bytes (lossless; compress_level 1: fast, still ~2x smaller)."""
    Image, _ = _pil()
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def array_to_rgb(images: np.ndarray, where: str) -> np.ndarray:
    """(N, H, W[, C]) in a supported dtype/range -> uint8 (N, H, W, 3). Raises ValueError
    naming ``where`` (the file or key) for anything outside the rule above."""
    x = np.asarray(images)
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or x.shape[-1] not in (1, 3, 4):
        hint = (" (channels first? transpose to (N, H, W, C))"
                if x.ndim == 4 and x.shape[1] in (1, 3, 4) else "")
        raise ValueError(f"{where}: images have shape {np.shape(images)}; accepted: (N, H, W) or "
                         f"(N, H, W, C) with C in 1, 3, 4{hint}")
    if x.shape[-1] == 4:
        x = x[..., :3]
    if x.dtype == np.uint8:
        pass
    elif x.dtype == np.uint16:
        x = np.rint(x.astype(np.float64) * (255.0 / 65535.0)).astype(np.uint8)
    elif np.issubdtype(x.dtype, np.integer):
        if x.size and (x.min() < 0 or x.max() > 255):
            raise ValueError(f"{where}: integer images must lie in [0, 255]; found "
                             f"[{x.min()}, {x.max()}]")
        x = x.astype(np.uint8)
    elif np.issubdtype(x.dtype, np.floating):
        if x.size and (not np.isfinite(x).all() or x.min() < 0 or x.max() > 1):
            raise ValueError(f"{where}: float images must lie in [0, 1]; found "
                             f"[{np.nanmin(x)}, {np.nanmax(x)}] (divide by 255 if they are pixels)")
        x = np.rint(x.astype(np.float64) * 255.0).astype(np.uint8)
    else:
        raise ValueError(f"{where}: images of dtype {x.dtype}; accepted: uint8, integers in "
                         f"[0, 255], uint16, or float in [0, 1]")
    if x.shape[-1] == 1:
        x = np.repeat(x, 3, axis=-1)
    return np.ascontiguousarray(x)
