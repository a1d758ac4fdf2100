"""InternVL's dynamic tiling: an image -> square tiles on the grid closest to its aspect ratio, plus a thumbnail.

As Hugging Face's ``GotOcr2ImageProcessorPil`` with ``crop_to_patches=True`` (what
``InternVLProcessor`` asks for): among the (columns, rows) grids with ``min_patches`` <= tiles <=
``max_patches``, ordered by tile count, pick the one whose columns / rows is closest to the image's
width / height (a tie goes to the larger grid while the image covers more than half of it); resize
the image through ``PIL.Image.resize`` to columns x rows tiles of ``tile`` pixels and cut it into
tiles in row-major order; when there is more than one tile, append the whole image resized to one
tile (the thumbnail). Each tile is rescaled and normalized as CLIP's (``preprocess``). The output is
bit-identical to the PIL backend.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
from PIL import Image

from conduit_rt.errors import ModelFormatError
from conduit_rt.preprocess import (
    ImageInput,
    _rescale_and_normalize,
    check_pixel_count,
    to_rgb_array,
)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@functools.lru_cache(maxsize=16)
def tile_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (columns, rows) with min_tiles <= columns * rows <= max_tiles, ordered by tile count
    (a stable sort of the columns-major enumeration, as transformers orders them)."""
    grids = [(columns, rows) for columns in range(1, max_tiles + 1) for rows in range(1, max_tiles + 1)
             if min_tiles <= columns * rows <= max_tiles]
    return tuple(sorted(grids, key=lambda grid: grid[0] * grid[1]))


def best_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of the grid whose aspect ratio is closest to the image's (see the module doc)."""
    aspect_ratio, area = width / height, width * height
    best_difference, best = float("inf"), (1, 1)
    for grid in tile_grids(min_tiles, max_tiles):
        difference = abs(aspect_ratio - grid[0] / grid[1])
        if difference < best_difference:
            best_difference, best = difference, grid
        elif difference == best_difference and area > 0.5 * tile * tile * grid[0] * grid[1]:
            best = grid
    return best


@dataclass(frozen=True, slots=True)
class TilePreprocessParams:
    """Preprocessing of InternVL: ``tile`` x ``tile`` tiles (see the module doc)."""

    tile: int = 448
    min_patches: int = 1
    max_patches: int = 12
    image_mean: tuple[float, float, float] = IMAGENET_MEAN
    image_std: tuple[float, float, float] = IMAGENET_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC.value
    do_rescale: bool = True
    do_normalize: bool = True
    kind: str = "internvl"

    def __post_init__(self) -> None:
        if self.tile < 1 or not 1 <= self.min_patches <= self.max_patches:
            raise ModelFormatError(
                f"invalid InternVL tiling: tile {self.tile}, min_patches {self.min_patches}, max_patches {self.max_patches}"
            )

    @classmethod
    def from_hf_config(cls, config: dict) -> TilePreprocessParams:
        """From a ``preprocessor_config.json`` of a GotOcr2ImageProcessor (``size`` is the tile)."""
        size = config.get("size") or {"height": 448, "width": 448}
        if int(size.get("height", 0)) != int(size.get("width", -1)):
            raise ModelFormatError(f"preprocessor_config.json: InternVL tiles must be square, got size {size!r}")
        defaults = cls()
        return cls(
            tile=int(size["height"]),
            min_patches=int(config.get("min_patches", defaults.min_patches)),
            max_patches=int(config.get("max_patches", defaults.max_patches)),
            image_mean=tuple(float(x) for x in config.get("image_mean", IMAGENET_MEAN)),
            image_std=tuple(float(x) for x in config.get("image_std", IMAGENET_STD)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            resample=int(config.get("resample", Image.Resampling.BICUBIC.value)),
            do_rescale=bool(config.get("do_rescale", True)),
            do_normalize=bool(config.get("do_normalize", True)),
        )

    def as_dict(self) -> dict:
        """Plain JSON-able dict of every field (what ``image_key`` hashes)."""
        return dataclasses.asdict(self)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(columns, rows) of the tiles an image of ``height`` x ``width`` pixels is cut into."""
        if self.max_patches == 1:
            return 1, 1
        return best_grid(height, width, self.tile, self.min_patches, self.max_patches)

    def n_tiles(self, height: int, width: int) -> int:
        """Tiles the tower sees for such an image: the grid's, plus the thumbnail when there are several."""
        columns, rows = self.grid(height, width)
        return columns * rows + (columns * rows > 1)

    def check_size(self, height: int, width: int) -> None:
        """ImageTooLargeError when the resized image (columns x rows tiles) would pass ``MAX_IMAGE_PIXELS``."""
        columns, rows = self.grid(height, width)
        check_pixel_count(columns * self.tile, rows * self.tile, f"{width}x{height} resized to tiles")

    def preprocess(self, image: ImageInput | np.ndarray) -> np.ndarray:
        """Pixel values of the tiles, then the thumbnail: [n_tiles, 3, tile, tile] float32."""
        rgb = to_rgb_array(image)
        columns, rows = self.grid(rgb.shape[0], rgb.shape[1])
        side = self.tile
        pil = Image.fromarray(rgb)
        canvas = np.asarray(pil.resize((columns * side, rows * side), resample=self.resample), dtype=np.uint8)
        tiles = [canvas[row * side:(row + 1) * side, column * side:(column + 1) * side]
                 for row in range(rows) for column in range(columns)]
        if len(tiles) > 1:
            tiles.append(np.asarray(pil.resize((side, side), resample=self.resample), dtype=np.uint8))
        return np.stack([_rescale_and_normalize(np.ascontiguousarray(tile.transpose(2, 0, 1)), self) for tile in tiles])
