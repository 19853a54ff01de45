"""Key rotation: every sealed value of the ledger opened and sealed again with the newest
key.
"""

from __future__ import annotations

from ..reseal import Reseal, Tally, reseal_tree
from .base import LedgerBase
from .core import (
    translate_errors,
)


class Resealing(LedgerBase):
    """Key rotation of the ledger's sealed values."""

    def reseal(self, reseal: Reseal, *, apply: bool) -> dict[str, Tally]:
        """Seal every stored value again with the newest key (``apply``), or count the values
        that need it; by collection: the records and their companions (groups, workflows and
        their events). The audit trail is append-only and holds no sealed values.

        A document is rewritten field by field, each write filtered on the field's value as
        read: a worker that changed it meanwhile (a checkpoint, a result) keeps its write, and
        the document is counted as changed meanwhile for the next pass.
        """
        database = self.collection.database
        prefix = f"{self.collection_name}_"
        with translate_errors("collection listing"):
            names = [
                name
                for name in database.list_collection_names()
                if name == self.collection_name
                or (name.startswith(prefix) and name != f"{prefix}audit")
            ]
        tallies: dict[str, Tally] = {}
        for name in sorted(names):
            collection = database.get_collection(name, write_concern=self._write_concern)
            tally = tallies[name] = Tally()
            # One pass in natural order: a document rewritten in place is not met again, and
            # one inserted meanwhile was sealed with the newest key by its writer anyway.
            with translate_errors("reseal"):
                for doc in collection.find({}, batch_size=500):
                    changes = {}
                    for field_name, value in doc.items():
                        new = value if field_name == "_id" else reseal_tree(value, reseal, tally)
                        if new is not value:
                            changes[field_name] = (value, new)
                    for field_name, (old, new) in changes.items() if apply else ():
                        done = collection.update_one(
                            {"_id": doc["_id"], field_name: old}, {"$set": {field_name: new}}
                        )
                        tally.changed_meanwhile += 1 - done.matched_count
        return tallies
