"""Reading prime-rl's lists: the trainer's split row is read as the row (one backward edge), anything
else is concatenated with ``cat``'s values and gradient, and malformed lists name the element."""

from __future__ import annotations

import pytest
import torch

from packloss.integrations.prime_rl.lists import concatenate, packed_trainer


def _not_one_split(lens: list[int]) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
    """``(leaf, list)`` pairs whose lists look like one split of a packed row but are not: each must
    get ``cat``'s values and send its gradient where ``cat`` sends it."""
    g = torch.Generator().manual_seed(3)
    leaf = torch.randn(2 * sum(lens), generator=g, requires_grad=True)
    row = leaf * 1.0  # a packed row with a graph, as a model's output is
    cases = {}
    cases["strided"] = (leaf, list(torch.split(row[::2], lens)))  # a view of the row, every other slot
    views = list(torch.split(row[: sum(lens)], lens))
    cases["swapped"] = (leaf, [views[1], views[0], *views[2:]])  # same lengths, wrong order
    cases["copy"] = (leaf, [*views[:-1], views[-1].clone()])  # last one a copy, not a view
    cases["two splits"] = (leaf, [*views[:-1], torch.split(row[sum(lens) :], lens)[-1]])  # last from another split
    offsets = [sum(lens[:i]) for i in range(len(lens))]
    cases["slices"] = (leaf, [row[o : o + n] for o, n in zip(offsets, lens, strict=True)])  # views, no split
    with torch.no_grad():
        own = row[: sum(lens)]  # a view of the row made without grad, then its own leaf
    own.requires_grad_()
    cases["leaf view"] = (own, list(torch.split(own, lens)))
    return cases


@pytest.mark.parametrize("case", ["strided", "swapped", "copy", "two splits", "slices", "leaf view"])
def test_lists_that_are_not_one_split_are_concatenated(case):
    """Only the exact outputs of one split take the no-``cat`` path; anything else gets ``cat``'s values
    and gradient (a wrong shortcut here would be a silent wrong number or a gradient sent elsewhere)."""
    lens = [5, 5, 7]
    leaf, seqs = _not_one_split(lens)[case]
    packed, _ = packed_trainer(seqs)
    expected = torch.cat(seqs)  # what the list holds, element by element
    assert torch.equal(packed, expected)
    weights = torch.arange(1.0, sum(lens) + 1)
    (grad,) = torch.autograd.grad((packed * weights).sum(), leaf, retain_graph=True)
    (grad_expected,) = torch.autograd.grad((expected * weights).sum(), leaf)
    assert torch.equal(grad, grad_expected)


def test_one_split_of_a_squeezed_row_is_read_without_cat():
    """A model's packed row is ``[1, T]``: the split of ``row[0]`` is read as a view of the row too."""
    lens = [3, 1, 4]
    leaf = torch.randn(1, 8, requires_grad=True)
    row = leaf * 2.0  # [1, T]
    seqs = list(torch.split(row[0], lens))
    packed, _ = packed_trainer(seqs)
    assert packed._base is row and torch.equal(packed, row[0])
    (grad,) = torch.autograd.grad((packed * torch.arange(8.0)).sum(), leaf)
    assert torch.equal(grad, 2.0 * torch.arange(8.0)[None])
    with pytest.raises(ValueError, match=r"trainer_logprobs\[1\] must have shape \(2,\), got \(1,\)"):  # other lengths
        concatenate("trainer_logprobs", seqs, (3, 2, 3))


def test_list_elements_of_the_wrong_shape_or_type_are_refused():
    lens = (3, 4)
    views = list(torch.split(torch.arange(7.0), list(lens)))
    with pytest.raises(ValueError, match=r"advantages\[1\] must have shape \(4,\), got \(1, 4\)"):
        concatenate("advantages", [views[0], views[1].view(1, 4)], lens)
    with pytest.raises(TypeError, match=r"advantages\[0\] must be a torch.Tensor, got list"):
        concatenate("advantages", [[0.0, 1.0, 2.0], views[1]], lens)
    with pytest.raises(ValueError, match="advantages holds 1 sequences, trainer_logprobs 2"):
        concatenate("advantages", views[:1], lens)


def test_trainer_lengths_come_from_the_list_unless_it_is_the_whole_split():
    """The split's own sizes stand in for a scan of ``trainer_logprobs`` only when the list is every
    output of that split: a prefix of it has its own lengths and total."""
    row = torch.randn(12, requires_grad=True) * 1.0
    whole, lens = packed_trainer(list(torch.split(row, [3, 4, 5])))
    assert lens == (3, 4, 5) and whole is row  # the whole row is used as it is
    prefix, lens = packed_trainer(list(torch.split(row, [3, 4, 5])[:2]))
    assert lens == (3, 4) and torch.equal(prefix, row[:7])
    with pytest.raises(TypeError, match=r"trainer_logprobs\[1\] must be a torch.Tensor, got list"):
        packed_trainer([row[:3], [0.0]])
