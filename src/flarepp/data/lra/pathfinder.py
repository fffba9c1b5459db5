"""Pathfinder (Linsley et al. 2018; Kim et al. 2020) at 32 x 32, as used by Long Range Arena.

Shape letters: B images generated together, R image side, C candidate paddles per image,
Q pixels of one candidate, S images of a split.

An image shows two marker dots and curved contours ("snakes") made of short straight
paddles; the label says whether the two dots lie on the same snake. The LRA images
(``lra_release/pathfinder32/curv_{baseline,contour_length_9,contour_length_14}``) were drawn
by the Pathfinder script (github.com/drewlinsley/pathfinder, ``snakes2.py``) with, at 32 px:
paddle length 2, paddle margin 1, two target snakes of ``contour_length`` paddles (6, 9 or
14 for the easy, intermediate and hard sets) whose first tips lie ``seed_distance = 7`` px
apart near the centre, ``20 // (contour_length // 3)`` distractor snakes of
``contour_length // 3`` paddles, single-paddle clutter filling the rest, marker discs of
radius 1.5 px, continuity 1.0: a new paddle turns by ``dtheta`` with probability
proportional to ``cos(min(|dtheta|, pi/2))^2``. A positive image marks both ends of one
target snake; a negative one the start of one target snake and the end of the other.

This generator follows those rules with two deliberate changes, so that the label is a
property of the pixels that a flood fill can check:

* a snake is drawn as an unbroken 8-connected chain of pixels: each paddle is a straight
  segment of ``paddle_length + margin = 3`` px (the paddle and the gap the original leaves
  before the next one), joined end to end;
* every object (target snake, distractor, clutter paddle, with a 3 x 3 marker block at both
  tips of a target snake) keeps one pixel of clearance from every other object: no pixel of
  one is among the 8 neighbours of a pixel of another. A snake may not touch its own pixels
  older than its previous paddle either (no self-crossing, as in the original).

Hence the dots are 8-connected through non-zero pixels iff the image is positive. Pixels:
0 background, 191 (paddle contrast 0.75) contours, 255 markers; no anti-aliasing.

Vectorisation: ``B`` images grow in lockstep, one paddle at a time. A snake's next paddle
is checked at every turning angle of the continuity law at once (a gather of the 3 x 3
neighbourhood of every candidate pixel in the occupancy grids), and the turn is drawn from
the law restricted to the free angles, as snakes2.py samples its law over the available
positions. First paddles (tips) take the first free of ``C`` random proposals. An image
whose target snakes get stuck is dropped and replaced (about 40 % of attempts succeed for
contour length 14, 85 % for 6).

Release format read by :func:`load_pathfinder`: ``<set>/imgs/<batch>/sample_<i>.png``
(8-bit grayscale) and ``<set>/metadata/<batch>.npy``, which despite its name is a text file,
one line per image: ``imgs/<batch> sample_<i>.png <i> <label> <continuity>
<contour_length> <distractor_length> <paddle_length> <paddle_thickness> <margin>
<contrasts>`` (the fields of ``snakes2.py``'s ``accumulate_meta``; LRA's TFDS builder reads
fields 0, 1 and 3). A metadata file saved as a real NumPy array of those strings is
accepted too. LRA splits each set 80 / 10 / 10 % into train / val / test.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from flarepp.data.base import DataError
from flarepp.data.generators._io import refuse_existing, write_atomically
from flarepp.data.lra.base import LRADataset, LRASplit, TokenSequences, missing

PATH_VALUE = 191
MARKER_VALUE = 255
DIFFICULTIES = {"curv_baseline": 6, "curv_contour_length_9": 9, "curv_contour_length_14": 14}
IMAGES_PER_FOLDER = 1000
_OFFSETS_9 = np.array([(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)], np.int32)  # 3 x 3 block


@dataclass(frozen=True, kw_only=True)
class PathfinderRules:
    """The drawing rules (module docstring); defaults are LRA's Pathfinder-32 hard set."""

    resolution: int = 32
    contour_length: int = 14
    paddle_length: int = 2
    margin: int = 1
    padding: int = 1
    seed_distance: float = 7.0
    continuity: float = 1.0
    clutter_attempts: int = 120
    candidates: int = 8  # random proposals for a snake's first paddle

    @property
    def step(self) -> int:
        """Pixels one paddle advances a snake: the paddle and its gap."""
        return self.paddle_length + self.margin

    @property
    def distractor_length(self) -> int:
        return max(1, self.contour_length // 3)

    @property
    def distractors(self) -> int:
        return 20 // self.distractor_length

    def metadata_fields(self) -> list[str]:
        """Fields 4.. of a metadata line, in ``snakes2.py``'s order."""
        return [f"{self.continuity}", f"{self.contour_length}", f"{self.distractor_length}",
                f"{self.paddle_length}", "0.5", f"{self.margin}", "1"]


def turn_law(continuity: float, step_degrees: float = 10.0) -> tuple[np.ndarray, np.ndarray]:
    """The turning angles a new paddle may take, every ``step_degrees`` in (-90, 90)
    degrees, and their weights ``cos(min(continuity |dtheta|, pi/2))^2`` (snakes2.py's
    continuity law; zero-weight angles are dropped). snakes2.py picks the next paddle among
    the pixels of a circle of radius 3, about 19 degrees apart, so 10 degrees is finer."""
    angles = np.deg2rad(np.arange(-90.0, 90.0 + step_degrees / 2, step_degrees))
    weight = np.cos(np.minimum(continuity * np.abs(angles), np.pi / 2)) ** 2
    keep = weight > 1e-12
    return angles[keep], weight[keep]


class _Canvas:
    """Occupancy of ``B`` images: which object drew each pixel, and at which paddle.

    ``state [B, R + 2, R + 2]`` int32 holds ``object * 256 + paddle`` (0 = background),
    with a one-pixel empty frame so that 3 x 3 neighbourhoods of edge pixels need no
    bounds checks; neighbourhoods are gathered through flat indices.
    """

    def __init__(self, batch: int, rules: PathfinderRules) -> None:
        self.rules = rules
        self.side = side = rules.resolution + 2
        self.state = np.zeros((batch, side, side), np.int32)
        self.neighbours = (_OFFSETS_9[:, 0] * side + _OFFSETS_9[:, 1]).astype(np.int32)

    def flat(self, rows: np.ndarray, pixels_BCQ2: np.ndarray) -> np.ndarray:
        """Flat indices into ``state`` of pixels ``[B, C, Q, 2]`` of images ``rows``."""
        base = (rows * self.side * self.side).astype(np.int32)
        return (base[:, None, None] + (pixels_BCQ2[..., 0] + 1) * self.side
                + pixels_BCQ2[..., 1] + 1)

    def blocked(self, rows: np.ndarray, pixels_BCQ2: np.ndarray, me: int,
                paddle: int) -> np.ndarray:
        """``[B, C]``: whether a candidate of images ``rows`` leaves the drawable area or
        comes within one pixel (8-neighbourhood) of another object or of its own pixels
        older than its previous paddle."""
        r = self.rules
        low, high = r.padding, r.resolution - 1 - r.padding
        outside = ((pixels_BCQ2 < low) | (pixels_BCQ2 > high)).any(axis=(-1, -2))
        flat = self.flat(rows, np.clip(pixels_BCQ2, 0, r.resolution - 1))
        near = np.take(self.state, flat[..., None] + self.neighbours)  # [B, C, Q, 9]
        own_recent_low, own_high = me * 256 + max(paddle - 1, 0), me * 256 + 255
        foreign = (near != 0) & ((near < own_recent_low) | (near > own_high))
        return outside | foreign.any(axis=(-1, -2))

    def draw(self, rows: np.ndarray, pixels_BQ2: np.ndarray, me: int, paddle: int) -> None:
        flat = self.flat(rows, pixels_BQ2[:, None])[:, 0]
        self.state.reshape(-1)[flat] = me * 256 + paddle

    def objects(self) -> np.ndarray:
        """``[B, R, R]``: the object drawn at each pixel (0 = background)."""
        return self.state[:, 1:-1, 1:-1] >> 8


def _segment_pixels(start_BC2: np.ndarray, angle_BC: np.ndarray, length: int) -> np.ndarray:
    """Pixels of straight segments from ``start`` along ``angle``, sampled every half pixel
    and rounded: consecutive samples land on equal or 8-adjacent pixels, so the chain is
    8-connected. ``[B, C, 2 * length + 1, 2]`` int."""
    t = (np.arange(2 * length + 1) / 2.0).astype(np.float32)
    direction = np.stack([np.sin(angle_BC), np.cos(angle_BC)], axis=-1).astype(np.float32)
    points = (start_BC2[..., None, :].astype(np.float32) + 0.5
              + t[:, None] * direction[..., None, :])
    return np.floor(points).astype(np.int32)


def _with_block(pixels_BCQ2: np.ndarray, centre_BC2: np.ndarray,
                marked_B: np.ndarray) -> np.ndarray:
    """Append the 3 x 3 block around ``centre`` (a marker's footprint) in the images
    ``marked``; elsewhere repeat the segment's last pixel, so that every candidate has the
    same pixel count and no space is kept for a marker that will not be drawn."""
    repeat = np.repeat(pixels_BCQ2[..., -1:, :], 9, axis=-2)
    block = np.floor(centre_BC2[..., None, :] + 0.5).astype(np.int32) + _OFFSETS_9
    extra = np.where(marked_B[:, None, None, None], block, repeat)
    return np.concatenate([pixels_BCQ2, extra], axis=-2)


class _Snakes:
    """Snakes of one object id per image, growing in lockstep across the images ``rows``
    that are still alive; tips, ends and headings are kept for the whole batch."""

    def __init__(self, canvas: _Canvas, rng: np.random.Generator) -> None:
        self.canvas, self.rng, self.rules = canvas, rng, canvas.rules
        self.turns, self.turn_weights = turn_law(self.rules.continuity)

    def _direction(self, angle: np.ndarray) -> np.ndarray:
        return self.rules.step * np.stack([np.sin(angle), np.cos(angle)], axis=-1)

    def start(self, alive_B: np.ndarray, tip_BC2: np.ndarray, heading_BC: np.ndarray,
              me: int, marked_B: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """First paddle from the first free of ``C`` candidate tips / headings per image,
        with a marker footprint at the tip in the images ``marked``. Returns whether it was
        drawn, the tip, the end and the heading, each ``[B, ...]``."""
        B = len(alive_B)
        rows = np.flatnonzero(alive_B)
        tip, heading = tip_BC2[rows], heading_BC[rows]
        pixels = _segment_pixels(tip, heading, self.rules.step)
        if marked_B is not None:
            pixels = _with_block(pixels, tip, marked_B[rows])
        free = ~self.canvas.blocked(rows, pixels, me, 0)
        ok, pick = free.any(axis=1), free.argmax(axis=1)
        drawn = rows[ok]
        self.canvas.draw(drawn, pixels[ok, pick[ok]], me, 0)
        out_tip, out_heading = np.zeros((B, 2)), np.zeros(B)
        out_tip[drawn], out_heading[drawn] = tip[ok, pick[ok]], heading[ok, pick[ok]]
        success = np.zeros(B, bool)
        success[drawn] = True
        return success, out_tip, out_tip + self._direction(out_heading), out_heading

    def extend(self, alive_B: np.ndarray, end_B2: np.ndarray, heading_B: np.ndarray, me: int,
               paddle: int, marked_B: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One more paddle per living snake. Every turning angle of :func:`turn_law` is
        checked; the turn is drawn from the law restricted to the free ones (as snakes2.py
        samples its continuity pmf over the available positions). A marker footprint goes
        at the new end in the images ``marked``. Returns (drawn, end, heading)."""
        rows = np.flatnonzero(alive_B)
        start = end_B2[rows, None, :]
        heading = heading_B[rows, None] + self.turns  # [b, A]
        new_end = start + self._direction(heading)
        pixels = _segment_pixels(np.broadcast_to(start, new_end.shape), heading,
                                 self.rules.step)
        if marked_B is not None:
            pixels = _with_block(pixels, new_end, marked_B[rows])
        weight = self.turn_weights * ~self.canvas.blocked(rows, pixels, me, paddle)
        cdf = np.cumsum(weight, axis=1)
        ok = cdf[:, -1] > 0
        pick = (cdf < (self.rng.random(len(rows)) * cdf[:, -1])[:, None]).sum(axis=1)
        pick = np.minimum(pick, len(self.turns) - 1)
        drawn = rows[ok]
        self.canvas.draw(drawn, pixels[ok, pick[ok]], me, paddle)
        success = np.zeros(len(alive_B), bool)
        success[drawn] = True
        end_B2, heading_B = end_B2.copy(), heading_B.copy()
        end_B2[drawn], heading_B[drawn] = new_end[ok, pick[ok]], heading[ok, pick[ok]]
        return success, end_B2, heading_B


def _draw_batch(batch: int, rules: PathfinderRules, rng: np.random.Generator
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``batch`` attempts: images ``[B, R, R]`` uint8, labels ``[B]``, success ``[B]``."""
    R, C = rules.resolution, rules.candidates
    canvas = _Canvas(batch, rules)
    snakes = _Snakes(canvas, rng)
    alive = np.ones(batch, bool)
    # Which tips carry the markers: the start of snake `origin`, and the end of the same
    # snake (positive) or of the other one (negative).
    labels = rng.integers(0, 2, batch)
    origin = rng.integers(0, 2, batch)
    terminal = np.where(labels == 1, origin, 1 - origin)

    # Two target snakes: first tips seed_distance apart, 2 * seed_distance from the border.
    margin = 2 * rules.seed_distance
    tip_a = rng.uniform(margin, R - 1 - margin, (batch, 1, 2)).repeat(C, axis=1)
    direction = rng.uniform(-np.pi, np.pi, (batch, C))
    tip_b = tip_a + rules.seed_distance * np.stack([np.sin(direction), np.cos(direction)], -1)
    tips, ends, headings = [], [], []
    for s, tip in enumerate((tip_a, tip_b)):
        ok, first, end, heading = snakes.start(alive, tip, rng.uniform(-np.pi, np.pi, (batch, C)),
                                               s + 1, origin == s)
        alive &= ok
        tips.append(first), ends.append(end), headings.append(heading)
    for paddle in range(1, rules.contour_length):
        for s in range(2):
            marked = (terminal == s) if paddle == rules.contour_length - 1 else None
            ok, ends[s], headings[s] = snakes.extend(alive, ends[s], headings[s], s + 1,
                                                     paddle, marked)
            alive &= ok

    # Distractor snakes (kept shorter when they get stuck) and single-paddle clutter.
    next_id = 3
    low, high = rules.padding, R - 1 - rules.padding
    for _ in range(rules.distractors):
        ok, _, end, heading = snakes.start(alive, rng.uniform(low, high, (batch, C, 2)),
                                           rng.uniform(-np.pi, np.pi, (batch, C)), next_id)
        for paddle in range(1, rules.distractor_length):
            ok, end, heading = snakes.extend(ok, end, heading, next_id, paddle)
        next_id += 1
    for _ in range(rules.clutter_attempts):
        snakes.start(alive, rng.uniform(low, high, (batch, 1, 2)),
                     rng.uniform(-np.pi, np.pi, (batch, 1)), next_id)
        next_id += 1

    images = np.where(canvas.objects() > 0, PATH_VALUE, 0).astype(np.uint8)
    rows = np.arange(batch)
    for centre in (np.stack(tips, 1)[rows, origin], np.stack(ends, 1)[rows, terminal]):
        yx = np.floor(centre + 0.5).astype(np.int64)[:, None, :] + _OFFSETS_9
        y, x = np.clip(yx[..., 0], 0, R - 1), np.clip(yx[..., 1], 0, R - 1)
        images[rows[:, None], y, x] = MARKER_VALUE
    return images, labels, alive


def generate_pathfinder(count: int, *, rules: PathfinderRules = PathfinderRules(),
                        seed: int = 0, batch: int = 1000, progress: bool = False
                        ) -> tuple[np.ndarray, np.ndarray]:
    """``count`` images ``[S, R, R]`` uint8 and labels ``[S]`` (1 = the dots are connected),
    drawn ``batch`` at a time (module docstring)."""
    if count < 0 or batch < 1:
        raise ValueError(f"count must be >= 0 and batch >= 1, got {count} and {batch}")
    rng = np.random.default_rng(seed)
    images, labels, have = [], [], 0
    with tqdm(total=count, desc="pathfinder", disable=not progress) as bar:
        while have < count:
            img, lab, ok = _draw_batch(batch, rules, rng)
            if not ok.any():
                raise RuntimeError(f"no Pathfinder image could be drawn with {rules}; the "
                                   "snakes do not fit the canvas")
            take = np.flatnonzero(ok)[: count - have]
            images.append(img[take]), labels.append(lab[take])
            have += len(take)
            bar.update(len(take))
    R = rules.resolution
    return (np.concatenate(images) if images else np.zeros((0, R, R), np.uint8),
            np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64))


def _png_bytes(image_RR: np.ndarray) -> bytes:
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(image_RR, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def make_pathfinder(out: str | Path, *, count: int = 10_000, difficulty: str =
                    "curv_contour_length_14", resolution: int = 32, seed: int = 0,
                    batch: int = 1000, progress: bool = True,
                    overwrite: bool = False) -> list[Path]:
    """Write ``count`` images in the release layout under ``out/<difficulty>/`` (module
    docstring); returns the metadata files. Images of a folder are written before its
    metadata file, which appears atomically, so a reader never sees a partial folder."""
    if count < 1:
        raise ValueError(f"Pathfinder count must be at least 1, got {count}")
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"unknown Pathfinder difficulty {difficulty!r}; known: "
                         f"{', '.join(DIFFICULTIES)}")
    rules = PathfinderRules(resolution=resolution, contour_length=DIFFICULTIES[difficulty])
    root = Path(out) / difficulty
    folders = range((count + IMAGES_PER_FOLDER - 1) // IMAGES_PER_FOLDER)
    metadata = [root / "metadata" / f"{f}.npy" for f in folders]
    refuse_existing(metadata, overwrite)
    images, labels = generate_pathfinder(count, rules=rules, seed=seed, batch=batch,
                                         progress=progress)
    for f in folders:
        folder = root / "imgs" / str(f)
        folder.mkdir(parents=True, exist_ok=True)
        lines = []
        for i in range(f * IMAGES_PER_FOLDER, min(count, (f + 1) * IMAGES_PER_FOLDER)):
            (folder / f"sample_{i}.png").write_bytes(_png_bytes(images[i]))
            lines.append(" ".join([f"imgs/{f}", f"sample_{i}.png", str(i), str(labels[i]),
                                   *rules.metadata_fields()]))
        text = ("\n".join(lines) + "\n").encode("ascii")
        write_atomically({metadata[f]: lambda handle, t=text: handle.write(t)})
    return metadata


def read_metadata(path: Path) -> list[tuple[str, str, int]]:
    """``(folder, file name, label)`` of each line of a release metadata file."""
    raw = path.read_bytes()
    if raw.startswith(b"\x93NUMPY"):
        rows = [list(map(str, row)) for row in np.load(path, allow_pickle=False)]
    else:
        rows = [line.split() for line in raw.decode("utf-8").splitlines() if line.strip()]
    out = []
    for number, row in enumerate(rows, 1):
        if len(row) < 4 or row[3] not in ("0", "1"):
            raise DataError(f"{path}: line {number} should read '<folder> <file> <index> "
                            f"<label 0|1> ...', got {' '.join(row)!r}")
        out.append((row[0], row[1], int(row[3])))
    return out


def _difficulty_folder(root: Path, difficulty: str) -> Path:
    for candidate in (root / difficulty, root):
        if (candidate / "metadata").is_dir():
            return candidate
    raise missing(root / difficulty / "metadata", f"Pathfinder {difficulty} metadata folder",
                  "Unpack lra_release.gz and point at lra_release/pathfinder32 (or its "
                  f"{difficulty} folder), or generate one with `flarepp lra data make "
                  "pathfinder --out DIR`")


def load_pathfinder(root: str | Path, *, difficulty: str = "curv_contour_length_14",
                    fractions: tuple[float, float] = (0.8, 0.9)) -> LRADataset:
    """A release set (or one :func:`make_pathfinder` wrote) as 1024-token pixel sequences,
    split train / val / test at ``fractions`` of the images in metadata order (LRA's
    80 / 10 / 10 %). Metadata files are taken in numeric order of their names."""
    from PIL import Image

    folder = _difficulty_folder(Path(root), difficulty)
    files = sorted(folder.glob("metadata/*.npy"),
                   key=lambda p: (not p.stem.isdigit(), int(p.stem) if p.stem.isdigit() else 0,
                                  p.stem))
    if not files:
        raise missing(folder / "metadata", "Pathfinder metadata files (*.npy)",
                      "The release keeps one per image folder")
    entries = [entry for path in files for entry in read_metadata(path)]
    pixels, side = [], None
    for sub, name, _ in entries:
        path = folder / sub / name
        if not path.is_file():
            raise missing(path, "Pathfinder image listed in the metadata", "Re-extract the set")
        image = np.asarray(Image.open(path).convert("L"))
        if side is None:
            side = image.shape
        if image.shape != side or image.shape[0] != image.shape[1]:
            raise DataError(f"{path}: image of shape {list(image.shape)}; expected square "
                            f"images all of shape {list(side)}")
        pixels.append(image.reshape(-1))
    tokens = np.stack(pixels)
    labels = np.array([label for _, _, label in entries], dtype=np.int64)
    cut = [round(f * len(entries)) for f in fractions]
    parts = {"train": slice(0, cut[0]), "val": slice(cut[0], cut[1]),
             "test": slice(cut[1], len(entries))}
    splits = {name: LRASplit((TokenSequences.from_padded(tokens[part]),), labels[part])
              for name, part in parts.items()}
    return LRADataset("pathfinder", splits, vocab_size=256, num_classes=2,
                      max_length=tokens.shape[1], source=str(folder),
                      facts={"resolution": int(side[0])}).validate()


def pathfinder_dataset(images: np.ndarray, labels: np.ndarray, *,
                       fractions: tuple[float, float] = (0.8, 0.9),
                       source: str = "generated") -> LRADataset:
    """Images ``[S, R, R]`` held in memory (e.g. from :func:`generate_pathfinder`) as an
    :class:`LRADataset` with LRA's 80 / 10 / 10 % split."""
    S, R, _ = images.shape
    cut = [round(f * S) for f in fractions]
    tokens = images.reshape(S, R * R)
    parts = {"train": slice(0, cut[0]), "val": slice(cut[0], cut[1]), "test": slice(cut[1], S)}
    splits = {name: LRASplit((TokenSequences.from_padded(tokens[part]),),
                             np.asarray(labels[part], dtype=np.int64))
              for name, part in parts.items()}
    return LRADataset("pathfinder", splits, vocab_size=256, num_classes=2, max_length=R * R,
                      source=source, facts={"resolution": R}).validate()


__all__ = ["DIFFICULTIES", "MARKER_VALUE", "PATH_VALUE", "PathfinderRules",
           "generate_pathfinder", "load_pathfinder", "make_pathfinder", "pathfinder_dataset",
           "read_metadata"]
