"""Data helpers a user relies on without seeing them."""

from ltmp.data import spread_subset


class ClassSorted:
    """Like ImageFolder: 10 classes of 100 images, sorted by class."""

    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return i, i // 100


def test_spread_subset_keeps_every_class():
    sub = spread_subset(ClassSorted(), 50)
    labels = [sub[i][1] for i in range(len(sub))]
    assert len(sub) == 50
    assert sorted(set(labels)) == list(range(10)) and all(labels.count(c) == 5 for c in range(10))
    assert [sub[i][0] for i in range(3)] == [0, 20, 40]  # the same images on every run


def test_spread_subset_all_images():
    ds = ClassSorted()
    assert spread_subset(ds, None) is ds and spread_subset(ds, 5000) is ds
