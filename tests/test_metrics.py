import math

import numpy as np

from routereplay import metrics


def test_logprob_metrics_values():
    d = np.array([0.0, 0.1, -1.0])
    m = metrics.logprob_metrics(d)
    k3 = np.mean(np.exp(d) - 1 - d)
    assert math.isclose(m["k3_kl"], k3, rel_tol=1e-12)
    assert math.isclose(m["mean_abs_dlogp"], 1.1 / 3)
    assert m["max_abs_dlogp"] == 1.0
    assert math.isclose(m["extreme_token_fraction"], 1 / 3)   # only |-1.0| > ln 2


def test_routing_agreement_sets_and_order():
    e = np.array([[[0, 1]], [[2, 3]], [[4, 5]]])
    t = np.array([[[1, 0]], [[2, 3]], [[4, 6]]])
    m = metrics.routing_agreement(e, t)
    assert math.isclose(m["routing_agreement"], 2 / 3)
    assert math.isclose(m["routing_agreement_ordered"], 1 / 3)
    m2 = metrics.routing_agreement(e, t, mask=np.array([True, True, False]))
    assert m2["routing_agreement"] == 1.0 and m2["num_rows"] == 2
