"""prism_runtime.data.units: Poisson sampling of people, random chunks of at most k records, and
micro-batches of whole people. Statistical checks are seeded and stated at 5 standard deviations
(a false failure at most ~6e-7 per check)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import AutoTokenizer

from prism_runtime.data import TokenizedDataset, length_groups, poisson_loader
from prism_runtime.data.units import (
    OPEN_KEY,
    UNIT_KEY,
    UserPoissonSampler,
    person_records,
    unit_index,
    unit_micro_batches,
    user_poisson_loader,
)
from prism_runtime.errors import ConfigError, DataError

Z = 5.0  # standard deviations of every statistical tolerance


def _rows(n: int) -> list[tuple[int]]:
    """A dataset of n rows whose items hold their own row number."""
    return [(i,) for i in range(n)]


def _rows_collate(items: list[tuple[int]]) -> dict[str, torch.Tensor]:
    return {"row": torch.tensor([item[0] for item in items], dtype=torch.long)}


def _people(counts: list[int]) -> list[list[int]]:
    """Row indices of people with ``counts`` records, rows numbered person by person."""
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 1, 1, 9, 2, 12, 3, 1, 5] * 3  # 48 people, 1..12 records


def test_person_records_group_rows_by_person_in_first_appearance_order() -> None:
    assert person_records(["b", "a", "b", 7, "a", "b"]) == [[0, 2, 5], [1, 4], [3]]
    with pytest.raises(DataError, match="2 of 4 rows have no person id"):
        person_records(["a", None, "b", None])
    with pytest.raises(DataError, match="row 1: a person id must be hashable"):
        person_records(["a", ["b"]])
    assert unit_index([2, 1, 3]).tolist() == [0, 0, 1, 2, 2, 2]


def test_people_at_a_given_rate_record_that_rate_exactly() -> None:
    """A secure-aggregation run's one public q over people: recorded as given (no b_u / N
    round trip), ``expected_users`` not used; a rate outside (0, 1] is refused."""
    records, q = _people(COUNTS), 0.1 / 3
    _, rate = user_poisson_loader(
        _rows(sum(COUNTS)),
        records,
        expected_users=10**6,
        max_records=4,
        collate_fn=_rows_collate,
        generator=torch.Generator().manual_seed(0),
        sample_rate=q,
    )
    assert rate == q
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match=f"sample rate must be in \\(0, 1\\], got {bad}"):
            user_poisson_loader(
                _rows(sum(COUNTS)),
                records,
                expected_users=1,
                max_records=4,
                collate_fn=_rows_collate,
                generator=torch.Generator().manual_seed(0),
                sample_rate=bad,
            )


def test_people_are_sampled_at_rate_q_over_people() -> None:
    """q = b_u / N_users; over T draws the mean number of sampled people is b_u and each person's
    inclusion frequency is q, both within 5 binomial standard deviations."""
    records, b_u, draws = _people(COUNTS), 12, 3000
    loader, q = user_poisson_loader(
        _rows(sum(COUNTS)),
        records,
        expected_users=b_u,
        max_records=4,
        collate_fn=_rows_collate,
        generator=torch.Generator().manual_seed(0),
    )
    n_users = len(records)
    assert q == b_u / n_users
    person_of = {row: p for p, rows in enumerate(records) for row in rows}
    hits = torch.zeros(n_users)
    sizes = []
    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    for batch in itertools.islice(batches, draws):
        people = {person_of[int(r)] for r in batch["row"]}
        assert len(people) == len(set(batch[UNIT_KEY].tolist()))
        sizes.append(len(people))
        hits[list(people)] += 1
    mean_sd = math.sqrt(n_users * q * (1 - q) / draws)
    assert abs(sum(sizes) / draws - b_u) <= Z * mean_sd
    rate_sd = math.sqrt(q * (1 - q) / draws)
    assert (hits / draws - q).abs().max().item() <= Z * rate_sd


def test_a_person_gives_at_most_k_records_all_of_them_when_fewer() -> None:
    k = 4
    sampler = UserPoissonSampler(
        _people(COUNTS), sample_rate=0.5, max_records=k, generator=torch.Generator().manual_seed(1)
    )
    person_of = {row: p for p, rows in enumerate(sampler.records) for row in rows}
    seen = 0
    for _ in range(20):
        for rows in sampler:
            per_person: dict[int, int] = {}
            for row in rows:
                per_person[person_of[row]] = per_person.get(person_of[row], 0) + 1
            for person, count in per_person.items():
                assert count == min(k, COUNTS[person])
            seen += len(per_person)
    assert seen > 100


def test_the_random_chunk_is_uniform_over_a_persons_records() -> None:
    """A person with n = 10 records and k = 4: each record is chosen with frequency k / n and
    each pair with k (k - 1) / (n (n - 1)), within 5 binomial standard deviations."""
    n, k, draws = 10, 4, 4000
    sampler = UserPoissonSampler(
        [list(range(n))], sample_rate=1.0, max_records=k, generator=torch.Generator().manual_seed(2)
    )
    single = torch.zeros(n)
    pairs = torch.zeros(n, n)
    for _ in range(draws):
        chunk = sampler.chunk(0)
        assert len(chunk) == len(set(chunk)) == k and chunk == sorted(chunk)
        single[chunk] += 1
        for i, j in itertools.combinations(chunk, 2):
            pairs[i, j] += 1
    p1 = k / n
    assert (single / draws - p1).abs().max().item() <= Z * math.sqrt(p1 * (1 - p1) / draws)
    p2 = k * (k - 1) / (n * (n - 1))
    upper = pairs[torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)] / draws
    assert (upper - p2).abs().max().item() <= Z * math.sqrt(p2 * (1 - p2) / draws)


def test_a_persons_rows_are_contiguous_and_unit_numbers_the_people() -> None:
    records = _people(COUNTS)
    person_of = {row: p for p, rows in enumerate(records) for row in rows}
    loader, _ = user_poisson_loader(
        _rows(sum(COUNTS)),
        records,
        expected_users=10,
        max_records=3,
        collate_fn=_rows_collate,
        generator=torch.Generator().manual_seed(3),
    )
    for _ in range(10):
        for batch in loader:
            rows, unit = batch["row"].tolist(), batch[UNIT_KEY].tolist()
            assert len(rows) == len(unit)
            owners = [person_of[r] for r in rows]
            runs = [p for p, _ in itertools.groupby(owners)]
            assert len(runs) == len(set(runs)) == (max(unit) + 1 if unit else 0)
            assert unit == [runs.index(p) for p in owners]  # unit i <-> the i-th person's run
            assert runs == sorted(runs)


def test_sampling_draws_only_from_the_sites_generator() -> None:
    """The global torch RNG is untouched; the same seed gives the same batches, another seed
    other batches."""

    def draw(seed: int) -> list[list[int]]:
        loader, _ = user_poisson_loader(
            _rows(sum(COUNTS)),
            _people(COUNTS),
            expected_users=8,
            max_records=2,
            collate_fn=_rows_collate,
            generator=torch.Generator().manual_seed(seed),
        )
        return [b["row"].tolist() for _ in range(3) for b in loader]

    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = draw(5)
    assert torch.equal(torch.get_rng_state(), before)
    assert draw(5) == first
    assert draw(6) != first


def test_one_record_per_person_gives_the_record_level_batches() -> None:
    n = 40
    record_level, q = poisson_loader(
        _rows(n),
        expected_batch_size=7,
        collate_fn=_rows_collate,
        generator=torch.Generator().manual_seed(4),
    )
    person_level, q_u = user_poisson_loader(
        _rows(n),
        [[i] for i in range(n)],
        expected_users=7,
        max_records=3,
        collate_fn=_rows_collate,
        generator=torch.Generator().manual_seed(4),
    )
    assert q == q_u
    a = [b["row"].tolist() for _ in range(3) for b in record_level]
    b = [b["row"].tolist() for _ in range(3) for b in person_level]
    assert a == b and len(a) == 3 * int(1 / q)


def test_the_loader_refuses_impossible_settings() -> None:
    records = _people([2, 3])
    kwargs = {"max_records": 2, "collate_fn": _rows_collate, "generator": torch.Generator()}
    with pytest.raises(ConfigError, match="between 1 and the number of people 2, got 3"):
        user_poisson_loader(_rows(5), records, expected_users=3, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_records must be at least 1"):
        UserPoissonSampler(records, sample_rate=0.5, max_records=0, generator=torch.Generator())


def _layout(seed: int) -> dict[str, torch.Tensor]:
    """A person-level batch: people of 1..7 rows with random token lengths, each row tagged with
    its original position (``row``) and person (``person``)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 8, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
    unit = unit_index(counts.tolist())
    rows = int(unit.shape[0])
    lengths = torch.randint(1, 20, (rows,), generator=g)
    mask = (torch.arange(20)[None, :] < lengths[:, None]).long()
    ids = torch.randint(5, 1000, (rows, 20), generator=g) * mask
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.randint(0, 2, (rows,), generator=g),
        "row": torch.arange(rows),
        "person": unit.clone(),
        UNIT_KEY: unit,
    }


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("by_length", [False, True])
def test_micro_batches_are_bounded_and_split_only_a_person_too_large(
    seed: int, by_length: bool
) -> None:
    """Every micro-batch has at most micro_batch_size rows; a person with at most that many rows
    is in exactly one micro-batch; a person with more spans consecutive micro-batches of their
    own, each but the last marked open on every row; unit numbers a micro-batch's people 0..P'-1
    in contiguous runs; together the micro-batches hold every row once, unchanged."""
    batch = _layout(seed)
    cap = 1 + seed % 5
    counts = torch.bincount(batch["person"]).tolist()
    pieces: dict[int, list[int]] = {}
    rows_seen: list[int] = []
    micros = list(unit_micro_batches(batch, cap, by_length=by_length))
    for micro_index, micro in enumerate(micros):
        unit, person = micro[UNIT_KEY].tolist(), micro["person"].tolist()
        runs = [p for p, _ in itertools.groupby(person)]
        assert len(runs) == len(set(runs))  # contiguous
        assert unit == [runs.index(p) for p in person]
        assert len(unit) <= cap
        open_ = micro[OPEN_KEY].tolist()
        assert len(set(open_)) == 1  # open on every row or on none
        if open_[0]:
            assert len(runs) == 1 and counts[runs[0]] > cap  # only a person too large continues
            assert micros[micro_index + 1]["person"].tolist()[0] == runs[0]  # in the next one
        for p in runs:
            pieces.setdefault(p, []).append(micro_index)
        width = micro["attention_mask"].shape[1]
        for r, ids in zip(micro["row"].tolist(), micro["input_ids"], strict=True):
            assert torch.equal(ids, batch["input_ids"][r, :width])
            assert not batch["input_ids"][r, width:].any()  # only padding was trimmed
        rows_seen += micro["row"].tolist()
    assert sorted(rows_seen) == list(range(int(batch["row"].shape[0])))
    assert set(pieces) == set(batch["person"].tolist())
    for p, where in pieces.items():
        assert len(where) == max(1, -(-counts[p] // cap))  # ceil(count / cap) when too large
        assert where == list(range(where[0], where[0] + len(where)))  # consecutive


def test_length_groups_of_single_rows_are_the_row_groups() -> None:
    """With one row per item the person-aware grouping is the row grouping, cut for cut."""
    g = torch.Generator().manual_seed(7)
    for cap in (1, 3, 8):
        lengths = sorted(torch.randint(1, 60, (30,), generator=g).tolist())
        assert length_groups(lengths, cap, counts=[1] * 30) == length_groups(lengths, cap)
    # an item larger than the cap stands alone; no group exceeds the cap otherwise
    sizes = length_groups([3, 4, 9, 10], 3, counts=[2, 5, 1, 2])
    assert sum(sizes) == 4
    assert sizes[:2] == [1, 1]


def test_unit_micro_batches_refuse_a_batch_that_is_not_person_level() -> None:
    batch = _layout(0)
    without = {k: v for k, v in batch.items() if k != UNIT_KEY}
    with pytest.raises(ValueError, match="needs its 'unit' tensor"):
        list(unit_micro_batches(without, 4))
    scrambled = dict(batch, unit=torch.tensor([0, 1, 0] + [2] * (batch["row"].shape[0] - 3)))
    with pytest.raises(ValueError, match="contiguous"):
        list(unit_micro_batches(scrambled, 4))
    empty = {k: v[:0] for k, v in batch.items()}
    assert list(unit_micro_batches(empty, 4)) == []


def test_a_tokenized_dataset_carries_the_rows_users(tiny_bert: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    rows = [{"text": f"row {i}", "label": i % 2, "user": f"u{i % 3}"} for i in range(6)]
    assert TokenizedDataset(rows, tokenizer, "seq-cls", max_length=8).users == [
        "u0", "u1", "u2", "u0", "u1", "u2"
    ]  # fmt: skip
    plain = [{k: v for k, v in r.items() if k != "user"} for r in rows]
    ds = TokenizedDataset(plain, tokenizer, "seq-cls", max_length=8)
    assert ds.users is None and "user" not in ds[0]
    with pytest.raises(DataError, match="1 of 6 rows have no 'user'"):
        TokenizedDataset([*rows[:5], plain[5]], tokenizer, "seq-cls", max_length=8)
