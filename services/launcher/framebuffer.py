"""A sandbox's screen as the node reads it: the display server's framebuffer file (X's XWD
format, as Xvfb keeps it with `-fbdir`) decoded, and a region of it encoded as PNG.

The file lies in the sandbox's own /tmp, so its bytes are the sandbox's to forge: the header is
checked field by field against the screen the node started (its size, 32 bits a pixel, masks of
whole bytes) and every offset against the bytes actually read, so a forged file gives a
`ValueError` and never a read out of bounds or a huge allocation. No pixel is interpreted
beyond being copied. PNG needs only zlib and struct.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

XWD_VERSION = 7
HEADER_FIELDS = 25  # CARD32s of an XWD file header, before the window name
MAX_HEADER = 4096  # header with the window name: Xvfb's name is a few bytes
MAX_COLORS = 65536
XWD_COLOR_BYTES = 12
Z_PIXMAP = 2


def file_limit(width: int, height: int) -> int:
    """The most bytes the framebuffer file of such a screen can have (what the node reads at most)."""
    return MAX_HEADER + MAX_COLORS * XWD_COLOR_BYTES + width * height * 4 + 4096


@dataclass(frozen=True)
class Framebuffer:
    width: int
    height: int
    stride: int  # bytes a row
    offset: int  # of the first pixel in `data`
    channels: tuple[int, int, int]  # byte index of red, green, blue within a pixel
    data: bytes


def parse_xwd(data: bytes, width: int, height: int) -> Framebuffer:
    """The framebuffer of a `width` x `height` screen; ValueError for anything else."""
    if len(data) < HEADER_FIELDS * 4:
        raise ValueError(f"the framebuffer file has {len(data)} bytes: no XWD header")
    order = next((o for o in (">", "<") if struct.unpack_from(o + "I", data, 4)[0] == XWD_VERSION), None)
    if order is None:
        raise ValueError("the framebuffer file is not XWD version 7")
    (header_size, _, pixmap_format, _, pix_width, pix_height, _, byte_order, _, _, _, bits_per_pixel, stride,
     _, red_mask, green_mask, blue_mask, _, _, ncolors, *_) = struct.unpack_from(f"{order}{HEADER_FIELDS}I", data)
    if (pix_width, pix_height) != (width, height):
        raise ValueError(f"the framebuffer is {pix_width}x{pix_height}, not the screen's {width}x{height}")
    if pixmap_format != Z_PIXMAP or bits_per_pixel != 32:
        raise ValueError(f"the framebuffer has format {pixmap_format} at {bits_per_pixel} bits a pixel, "
                         "not ZPixmap at 32")
    if not HEADER_FIELDS * 4 <= header_size <= MAX_HEADER or ncolors > MAX_COLORS:
        raise ValueError(f"the framebuffer's header is {header_size} bytes with {ncolors} colours")
    if not width * 4 <= stride <= width * 4 + 64:
        raise ValueError(f"the framebuffer's rows are {stride} bytes for {width} pixels")
    offset = header_size + ncolors * XWD_COLOR_BYTES
    if len(data) < offset + stride * height:
        raise ValueError(f"the framebuffer file has {len(data)} bytes, short of its {offset + stride * height}")
    channels = tuple(_byte_of(mask, byte_order) for mask in (red_mask, green_mask, blue_mask))
    if len(set(channels)) != 3:
        raise ValueError("the framebuffer's colour masks overlap")
    return Framebuffer(width, height, stride, offset, channels, data)  # type: ignore[arg-type]


def _byte_of(mask: int, byte_order: int) -> int:
    """Where a channel of 8 bits sits in a 32-bit pixel stored with `byte_order` (0: LSB first)."""
    shifts = {0xFF << (8 * i): i for i in range(4)}
    if mask not in shifts or byte_order not in (0, 1):
        raise ValueError(f"the framebuffer's colour mask {mask:#x} (byte order {byte_order}) is not a whole byte")
    return shifts[mask] if byte_order == 0 else 3 - shifts[mask]


def png(fb: Framebuffer, x: int, y: int, width: int, height: int, level: int = 1) -> bytes:
    """The region (x, y, width, height) of the framebuffer as an 8-bit RGB PNG; the caller keeps
    the region on the screen (ValueError if it is not)."""
    if x < 0 or y < 0 or width < 1 or height < 1 or x + width > fb.width or y + height > fb.height:
        raise ValueError(f"region {width}x{height} at ({x}, {y}) is not within the {fb.width}x{fb.height} screen")
    row_bytes = width * 4
    if x == 0 and width == fb.width and fb.stride == row_bytes:
        start = fb.offset + y * fb.stride
        pixels: bytes | bytearray = fb.data[start:start + row_bytes * height]
    else:
        pixels = bytearray(row_bytes * height)
        for row in range(height):
            start = fb.offset + (y + row) * fb.stride + x * 4
            pixels[row * row_bytes:(row + 1) * row_bytes] = fb.data[start:start + row_bytes]
    rgb = bytearray(width * height * 3)
    for out, channel in enumerate(fb.channels):
        # Strided slices of bytes are C loops (a strided memoryview is 8x slower): no per-pixel Python.
        rgb[out::3] = pixels[channel::4]
    line = width * 3
    scanlines = bytearray((line + 1) * height)  # each row led by filter type 0 (none)
    for row in range(height):
        scanlines[row * (line + 1) + 1:(row + 1) * (line + 1)] = rgb[row * line:(row + 1) * line]
    return b"".join([
        b"\x89PNG\r\n\x1a\n",
        _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)),
        _chunk(b"IDAT", zlib.compress(scanlines, level)),
        _chunk(b"IEND", b""),
    ])


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
