"""numba kernels of the feature computation over flat (offsets, values) arrays.

Every collection of a chunk is one offsets array (``off[e]:off[e + 1]`` are the entries of event
``e``) and flat float64 value arrays. The particle-flow candidates of all kinds are merged into one
table sorted by eta within each event (``kind`` 0 track, 1 photon, 2 neutral hadron), so a cone of
radius R around a particle only scans the candidates whose eta lies within R of it (a binary
search, then a scan that stops at the window's end): the isolation sums cost
O(n log n + n * k) per event for n candidates and k per cone, instead of the n^2 of all pairs.

Definitions shared with the reference implementation (the per-event numpy test, bench/features.py):
``dphi = (a - b + pi) mod 2 pi - pi``, ``dR^2 = deta^2 + dphi^2`` in float64, "within the cone"
is ``dR^2 < R^2``. The callers live in :mod:`pipeline.features.delphes`.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

#: slack on the eta window bounds; the dR^2 test decides
_EPS = 1e-9


@njit(cache=True, inline="always")
def _dphi(a, b):
    return (a - b + math.pi) % (2.0 * math.pi) - math.pi


@njit(cache=True)
def _cone(eta0, phi0, s, t, c_eta, c_phi, c_pt, c_kind, cone, excl2, excl_kind):
    """Sums of ``c_pt`` per kind over candidates ``s:t`` (sorted by eta) with dR^2 < cone^2 from
    (eta0, phi0), leaving out candidates of ``excl_kind`` with dR^2 < excl2."""
    cone2 = cone * cone
    lo = s + np.searchsorted(c_eta[s:t], eta0 - cone - _EPS)
    a = 0.0
    b = 0.0
    c = 0.0
    hi = eta0 + cone + _EPS
    for j in range(lo, t):
        if c_eta[j] > hi:
            break
        de = c_eta[j] - eta0
        dp = _dphi(c_phi[j], phi0)
        d2 = de * de + dp * dp
        if d2 < cone2:
            k = c_kind[j]
            if k == excl_kind and d2 < excl2:
                continue
            if k == 0:
                a += c_pt[j]
            elif k == 1:
                b += c_pt[j]
            else:
                c += c_pt[j]
    return a, b, c


@njit(cache=True)
def cone_sums(q_evt, q_eta, q_phi, c_off, c_eta, c_phi, c_pt, c_kind, cone, excl2, excl_kind):
    """(n_queries, 3) float64: per query particle, the candidate pT sums of each kind in its cone."""
    out = np.zeros((len(q_evt), 3))
    for i in range(len(q_evt)):
        e = q_evt[i]
        a, b, c = _cone(q_eta[i], q_phi[i], c_off[e], c_off[e + 1], c_eta, c_phi, c_pt, c_kind, cone, excl2,
                        excl_kind)
        out[i, 0] = a
        out[i, 1] = b
        out[i, 2] = c
    return out


@njit(cache=True)
def select_leptons(l_off, l_pt, l_eta, l_phi, l_q, l_ele, c_off, c_eta, c_phi, c_pt, c_kind,
                   cone, excl2, iso_max):
    """Per event, the highest-pT lepton with relative isolation < iso_max (ties: the first).

    ``l_*`` are the lepton candidates above threshold, electrons before muons within an event.
    Tracks within dR^2 < excl2 of the lepton (its own track) are left out of its sums.
    Returns (chosen (n,) bool, lepton (n, 8) float64: pt, eta, phi, charge, is_ele, iso_ch,
    iso_gamma, iso_neu).
    """
    n = len(l_off) - 1
    chosen = np.zeros(n, np.bool_)
    lep = np.zeros((n, 8))
    for e in range(n):
        best = -1.0
        for j in range(l_off[e], l_off[e + 1]):
            pt = l_pt[j]
            a, b, c = _cone(l_eta[j], l_phi[j], c_off[e], c_off[e + 1], c_eta, c_phi, c_pt, c_kind, cone,
                            excl2, 0)
            ich, igam, ineu = a / pt, b / pt, c / pt
            if ich + igam + ineu < iso_max and pt > best:
                best = pt
                chosen[e] = True
                lep[e, 0] = pt
                lep[e, 1] = l_eta[j]
                lep[e, 2] = l_phi[j]
                lep[e, 3] = l_q[j]
                lep[e, 4] = l_ele[j]
                lep[e, 5] = ich
                lep[e, 6] = igam
                lep[e, 7] = ineu
    return chosen, lep


@njit(cache=True)
def _top(off, pt, e, cap):
    """Indices of the ``cap`` highest-pT entries of event ``e`` (stable: ties keep their order)."""
    s, t = off[e], off[e + 1]
    order = np.argsort(-pt[s:t], kind="mergesort")
    return s + order[:cap]


@njit(cache=True)
def _p4_row(row, pt, eta, phi):
    row[0] = pt * math.cosh(eta)
    row[1] = pt * math.cos(phi)
    row[2] = pt * math.sin(phi)
    row[3] = pt * math.sinh(eta)
    row[4] = pt
    row[5] = eta
    row[6] = phi


@njit(cache=True)
def _fill(kinds, idx, dr, r, k, sel, eta, phi, leta, lphi):
    """Append the particles ``sel`` of kind ``k`` with their float32 dR from the lepton; the next slot."""
    for j in sel:
        de = eta[j] - leta
        dp = _dphi(phi[j], lphi)
        kinds[r] = k
        idx[r] = j
        dr[r] = np.float32(math.sqrt(de * de + dp * dp))
        r += 1
    return r


@njit(cache=True)
def low_level(evt, lep, t_off, t_pt, t_eta, t_phi, t_q, t_pid, t_x, t_y, t_z,
              p_off, p_pt, p_eta, p_phi, n_off, n_pt, n_eta, n_phi,
              c_off, c_eta, c_phi, c_pt, c_kind, caps, cone, excl2, out, npart):
    """Fill ``out`` ((k, N_PARTICLES, 19) float32, zeroed) and ``npart`` ((k,) int32) for the events
    ``evt`` with leptons ``lep`` ((k, 8) as :func:`select_leptons` gives them).

    Row 0 the lepton; then the tracks (the lepton's own track, dR^2 < excl2, removed), photons and
    neutral hadrons, each cut to the highest-pT ``caps[kind]``, ordered by decreasing float32 dR
    from the lepton (stable over tracks, photons, neutrals, each in decreasing pT).
    """
    row = np.zeros(19)
    for i in range(len(evt)):
        e = evt[i]
        lpt, leta, lphi = lep[i, 0], lep[i, 1], lep[i, 2]
        row[:] = 0.0
        _p4_row(row, lpt, leta, lphi)
        row[10] = lep[i, 5]
        row[11] = lep[i, 6]
        row[12] = lep[i, 7]
        row[16] = lep[i, 4]
        row[17] = 1.0 - lep[i, 4]
        row[18] = lep[i, 3]
        for f in range(19):
            out[i, 0, f] = row[f]
        # the lepton's own track is not a particle of the list
        keep = np.empty(t_off[e + 1] - t_off[e], np.bool_)
        for j in range(t_off[e], t_off[e + 1]):
            de = t_eta[j] - leta
            dp = _dphi(t_phi[j], lphi)
            keep[j - t_off[e]] = de * de + dp * dp >= excl2
        trk = t_off[e] + np.flatnonzero(keep)
        trk = trk[np.argsort(-t_pt[trk], kind="mergesort")][:caps[0]]
        pho = _top(p_off, p_pt, e, caps[1])
        neu = _top(n_off, n_pt, e, caps[2])
        m = len(trk) + len(pho) + len(neu)
        kinds = np.empty(m, np.int64)
        idx = np.empty(m, np.int64)
        dr = np.empty(m, np.float32)
        r = _fill(kinds, idx, dr, 0, 0, trk, t_eta, t_phi, leta, lphi)
        r = _fill(kinds, idx, dr, r, 1, pho, p_eta, p_phi, leta, lphi)
        _fill(kinds, idx, dr, r, 2, neu, n_eta, n_phi, leta, lphi)
        order = np.argsort(-dr, kind="mergesort")
        s, t = c_off[e], c_off[e + 1]
        for slot in range(m):
            q = order[slot]
            k, j = kinds[q], idx[q]
            row[:] = 0.0
            if k == 0:
                pt, eta, phi = t_pt[j], t_eta[j], t_phi[j]
            elif k == 1:
                pt, eta, phi = p_pt[j], p_eta[j], p_phi[j]
            else:
                pt, eta, phi = n_pt[j], n_eta[j], n_phi[j]
            _p4_row(row, pt, eta, phi)
            sums = _cone(eta, phi, s, t, c_eta, c_phi, c_pt, c_kind, cone, -1.0, -1)
            for g in range(3):
                v = sums[g] - pt if g == k else sums[g]
                row[10 + g] = max(v, 0.0) / pt
            if k == 0:
                row[7] = t_x[j]
                row[8] = t_y[j]
                row[9] = t_z[j]
                apid = abs(t_pid[j])
                is_e = 1.0 if apid == 11 else 0.0
                is_m = 1.0 if apid == 13 else 0.0
                row[13] = 1.0 - is_e - is_m
                row[16] = is_e
                row[17] = is_m
                row[18] = t_q[j]
            elif k == 1:
                row[15] = 1.0
            else:
                row[14] = 1.0
            for f in range(19):
                out[i, 1 + slot, f] = row[f]
        npart[i] = 1 + m
