import pytest
import torch

from deepinfer_vllm.ops.indexer import candidate_block_mask, index_scores, select_topk, visible_compressed

NEG = float("-inf")


def test_visible_compressed():
    p = torch.arange(6)
    assert visible_compressed(p, 2).tolist() == [0, 1, 1, 2, 2, 3]  # own pair only once p is odd
    assert visible_compressed(p, 1).tolist() == [1, 2, 3, 4, 5, 6]  # ratio 1 includes its own entry


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_scores_against_loop(dtype):
    g = torch.Generator().manual_seed(0)
    Tq, H, Dk, N = 5, 3, 8, 6
    q = torch.randn(Tq, H, Dk, generator=g).to(dtype)
    w = torch.randn(Tq, H, generator=g).to(dtype)
    k = torch.randn(N, Dk, generator=g).to(dtype)
    vis = torch.tensor([0, 1, 3, 6, 4])
    s = index_scores(q, w, k, vis)
    assert s.dtype == torch.float32 and s.shape == (Tq, N)
    for t in range(Tq):
        for j in range(N):
            if j >= vis[t]:
                assert s[t, j].item() == NEG
                continue
            want = sum(w[t, h].double() * torch.relu(q[t, h].double() @ k[j].double()) for h in range(H))
            assert abs(s[t, j].item() - float(want)) <= (1e-5 if dtype == torch.float32 else 1e-2 * abs(float(want)) + 1e-3)
            assert s[t, j].item() == s[t, j].to(dtype).item()  # rounded to the model dtype
    # causality: keys a query cannot see do not influence its visible scores
    k2 = k.clone()
    k2[4:] = 100
    s2 = index_scores(q, w, k2, vis)
    assert torch.equal(s2[:3], s[:3])


def _naive_blocks(scores, visible, bs, topk):
    out = []
    for t, row in enumerate(scores.tolist()):
        v = int(visible[t])
        nb = (len(row) + bs - 1) // bs
        bscore = []
        for b in range(nb):
            vals = [row[j] for j in range(b * bs, min(len(row), b * bs + bs)) if j < v]
            bscore.append(max(vals) if vals else NEG)
        if v > 0:
            bscore[(v - 1) // bs] = float("inf")
        order = sorted(range(nb), key=lambda b: (-bscore[b], b))
        kept = {b for b in order[:topk] if bscore[b] > NEG}
        out.append([(j // bs) in kept and j < v for j in range(len(row))])
    return torch.tensor(out)


def test_candidate_blocks_pin_newest_and_ties():
    # N = 9, block size 2 -> blocks {0,1} {2,3} {4,5} {6,7} {8}
    s = torch.tensor([
        [5.0, 1.0, 5.0, 0.0, 9.0, 0.0, -1.0, -2.0, 7.0],   # visible 8: newest block 3 pinned despite low score
        [5.0, 1.0, 5.0, 0.0, 9.0, 0.0, -1.0, -2.0, 7.0],   # visible 9: block 4 pinned; blocks 0,1 tie at 5
        [NEG, NEG, NEG, NEG, 3.0, NEG, NEG, NEG, NEG],     # visible 6: only block 2 is finite (and pinned)
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],     # visible 0: nothing
    ])
    vis = torch.tensor([8, 9, 6, 0])
    m = candidate_block_mask(s, vis, 2, 2)
    assert m.dtype == torch.bool
    assert m.tolist() == _naive_blocks(s, vis, 2, 2).tolist()
    assert m[0].nonzero().view(-1).tolist() == [4, 5, 6, 7]        # best block 2 + pinned block 3
    assert m[1].nonzero().view(-1).tolist() == [4, 5, 8]           # pinned 4 + best block 2
    m3 = candidate_block_mask(s, vis, 2, 3)
    assert m3[1].nonzero().view(-1).tolist() == [0, 1, 4, 5, 8]    # tie 0 vs 1 at 5.0 -> block 0
    assert m3[2].nonzero().view(-1).tolist() == [4, 5]             # all -inf blocks never kept
    assert not m[3].any()


def test_candidate_blocks_random_against_loop():
    g = torch.Generator().manual_seed(3)
    s = torch.randint(-3, 4, (20, 23), generator=g).float()  # many ties
    s[s == -3] = NEG
    vis = torch.randint(0, 24, (20,), generator=g)
    for bs, k in [(2, 3), (4, 2), (8, 1), (3, 10)]:
        assert candidate_block_mask(s, vis, bs, k).tolist() == _naive_blocks(s, vis, bs, k).tolist()


def test_select_topk_ties_fill_and_order():
    s = torch.tensor([
        [1.0, 3.0, 3.0, 2.0, 3.0, NEG],
        [NEG, 0.5, NEG, NEG, NEG, NEG],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ])
    out = select_topk(s, 3)
    assert out.dtype == torch.int64
    assert out.tolist() == [[1, 2, 4], [1, -1, -1], [0, 1, 2]]
    assert select_topk(s, 2).tolist() == [[1, 2], [1, -1], [0, 1]]  # tie at 3.0: lower indices 1, 2 win
    assert select_topk(s[:, :2], 4).tolist() == [[0, 1, -1, -1], [1, -1, -1, -1], [0, 1, -1, -1]]


def test_select_topk_random_against_loop():
    g = torch.Generator().manual_seed(9)
    s = torch.randint(-2, 3, (30, 17), generator=g).float()
    s[s == -2] = NEG
    out = select_topk(s, 5)
    for t, row in enumerate(s.tolist()):
        order = sorted((j for j in range(17) if row[j] > NEG), key=lambda j: (-row[j], j))[:5]
        want = sorted(order) + [-1] * (5 - len(order))
        assert out[t].tolist() == want
