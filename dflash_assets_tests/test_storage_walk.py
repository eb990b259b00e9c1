"""The drafter's data path goes down the rooms (issue 51): followed as the ``storage`` parameter of the
``dflash_drafter`` asset (``storage_walk``: how the walk is read and a climb counted), the storage plan is decided
in one place below the drafter's stage code, and the walk climbs back up at most 4 times (6 when counted at
1119868, in source order; 5 in evaluation order)."""

from dflash_assets_tests.storage_walk import drafter_storage_walk, rank_of, room_of

MAX_CLIMBS = 4


def test_rooms_are_found_for_each_kind_of_module():
    assert room_of("dflash_assets.assets.drafter") == "assets"
    assert room_of("dflash_assets.stages.drafter.run") == "stages/drafter"
    assert room_of("dflash_assets.stages.storage_plan") == "stages/<shared>"
    assert room_of("dflash_assets.stages.resources.storage") == "stages/resources"
    assert room_of("dflash_assets.generation.client.attempts") == "generation/client"
    assert room_of("dflash_assets.storage.store") == "storage"
    assert rank_of("stages/drafter") < rank_of("stages/<shared>") < rank_of("stages/resources") < rank_of("storage")


def test_the_drafter_storage_walk_goes_down():
    walk = drafter_storage_walk()
    stays = [f"{s.module.removeprefix('dflash_assets.')}:{s.function}" for s in walk.stays]
    assert stays[0] == "assets.drafter:dflash_drafter"
    # the feature source is decided with the storage plan, in one place, below the drafter's stage code
    assert "stages.storage_plan:feature_source" in stays and "stages.storage_plan:storage_plan" in stays
    assert "stages/hidden_states" not in walk.rooms, "the drafter's data path reads another stage's code"
    # the value reaches the store
    assert any(s.startswith("storage.store:Storage.") for s in stays)
    climbs = [f"{a} -> {b}" for a, b in walk.climbs]
    assert len(climbs) <= MAX_CLIMBS, "climbs back up: " + "; ".join(climbs)
