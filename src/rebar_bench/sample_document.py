"""A 40-page sample document written for rebar's document tests and benchmark (released by the
project into the public domain): ten chapters on honey bees and beekeeping, four pages each, every
page about its own subject. `sample_pdf()` lays it out as a text PDF with one outline entry per
chapter, one page per entry of `PAGES`."""

from __future__ import annotations

TITLE = "The Honey Bee Colony"
SUBJECT = "bees"  # what a summary of this document must mention

_THE_COLONY = [
    "A honey bee colony is a single family of bees living together in one nest. It holds one "
    "queen, many thousands of female workers and, in summer, a few hundred male drones.\n\nNo "
    "bee can live alone for long. The colony behaves like one animal whose organs are the "
    "different groups of bees.",
    "Wild colonies nest in hollow trees, rock crevices and the walls of old buildings. A "
    "cavity of about forty litres with a small entrance high above the ground suits them "
    "best.\n\nInside the cavity the bees hang parallel sheets of wax comb from the ceiling, "
    "leaving a gap one bee wide between them.",
    "A strong colony in midsummer may hold sixty thousand bees. In winter the same colony "
    "shrinks to perhaps ten thousand, living on stored honey.\n\nThe size of the colony rises "
    "and falls with the flowers of the season around it.",
    "Beekeepers house colonies in wooden hives with movable frames. Each frame holds one "
    "comb, so the keeper can lift it out and inspect the brood and stores without harm.\n\nThe"
    " movable frame hive was the great invention that made modern beekeeping possible.",
]
_THE_QUEEN = [
    "The queen is the mother of every bee in the colony. She is longer than a worker, with a "
    "tapering abdomen that reaches well beyond her folded wings.\n\nA good queen lays up to "
    "two thousand eggs a day at the height of spring.",
    "A queen is raised from an ordinary fertilised egg. The workers build a large cell that "
    "hangs downward and feed the larva royal jelly throughout its growth.\n\nThis rich food, "
    "not any difference in the egg, turns the larva into a queen.",
    "About a week after she emerges, the young queen flies out to mate with drones in the "
    "air, often far from the hive. She mates with a dozen or more drones over a few flights."
    "\n\nShe stores their sperm for the rest of her life and never mates again.",
    "The queen spreads a scent called queen substance through the colony. Workers lick it "
    "from her body and pass it to one another.\n\nWhen the scent fades because the queen is "
    "old or lost, the workers start raising a new queen at once.",
]
_WORKERS = [
    "Worker bees are sterile females and do almost all the work of the colony. A summer "
    "worker lives only about six weeks.\n\nHer duties change with her age, from cleaning cells"
    " to foraging in the fields.",
    "Young workers are nurse bees. Glands in their heads make brood food, which they feed to "
    "the larvae many hundreds of times a day.\n\nNurse bees also feed and groom the queen.",
    "Middle-aged workers build comb from wax made by glands under their abdomens. They also "
    "receive nectar from foragers and store it in cells.\n\nSome of them stand guard at the "
    "entrance and sting intruders.",
    "The oldest workers become foragers. They fly up to three kilometres from the hive to "
    "gather nectar, pollen, water and plant resin.\n\nForaging wears out their wings, and most"
    " foragers die in the field after a few weeks.",
]
_DRONES = [
    "Drones are the male bees. They are larger and stouter than workers, with huge eyes that "
    "meet at the top of the head.\n\nDrones have no sting and do not gather food.",
    "A drone develops from an unfertilised egg, so he has a mother but no father. His only "
    "task is to mate with a young queen from another colony.\n\nA drone dies in the act of "
    "mating.",
    "Drones gather in congregation areas, places in the open air where thousands of drones "
    "from many colonies circle on warm afternoons.\n\nA young queen flies into such an area to"
    " mate, which keeps the families from inbreeding.",
    "In autumn, when nectar runs short, the workers drag the drones out of the hive and leave"
    " them to starve.\n\nA colony cannot afford to feed males through the winter.",
]
_HONEY = [
    "Honey begins as nectar, a sugary liquid that flowers make to attract insects. A forager "
    "sucks nectar into her honey stomach and carries it home.\n\nOne forager may visit more "
    "than a thousand flowers in a day.",
    "In the hive, worker bees add enzymes to the nectar that turn its sucrose into simpler "
    "sugars. They spread it thinly in cells to dry.\n\nFanning bees drive warm air over the "
    "comb until the water content falls below twenty percent.",
    "When the honey is ripe the bees seal each cell with a thin cap of wax. Sealed honey "
    "keeps for years without spoiling.\n\nThe colony eats this stored honey through the winter"
    " and in bad weather.",
    "The beekeeper takes only the surplus honey. Frames of sealed honey are uncapped with a "
    "warm knife and spun in an extractor.\n\nEnough honey must always be left for the bees to "
    "survive the winter.",
]
_POLLEN_AND_POLLINATION = [
    "Pollen is the protein food of the colony. Foragers pack it into baskets on their hind "
    "legs and carry it home as bright pellets.\n\nNurse bees need pollen to make brood food "
    "for the larvae.",
    "Bees store pollen in cells near the brood, mixed with a little honey. This fermented "
    "store is called bee bread.\n\nA colony uses twenty to thirty kilograms of pollen in a "
    "year.",
    "While gathering food, bees carry pollen from flower to flower and so pollinate the "
    "plants. Many fruit trees set little fruit without them.\n\nApples, cherries, almonds and "
    "blueberries all depend heavily on pollinating insects.",
    "A forager tends to visit one kind of flower on each trip. This flower constancy makes "
    "her an efficient pollinator.\n\nFarmers often rent hives of bees to pollinate orchards "
    "when the trees bloom.",
]
_WAX_AND_COMB = [
    "Beeswax is made by four pairs of glands on the underside of the worker abdomen. The wax "
    "appears as thin white scales.\n\nBees must eat a lot of honey to produce a little wax.",
    "Comb is built of six-sided cells that share their walls. The hexagon holds the most "
    "honey for the least wax.\n\nThe cells slope slightly upward so that honey does not run "
    "out.",
    "The same comb serves many purposes. Its cells hold eggs, larvae and pupae, as well as "
    "honey and pollen.\n\nDrone cells are larger than worker cells, and queen cells hang apart"
    " from the rest.",
    "Beeswax has long been used for candles, polish and waterproofing. Candles of beeswax "
    "burn bright and clean.\n\nOld dark comb is melted down by beekeepers to recover its wax.",
]
_THE_DANCE_LANGUAGE = [
    "A forager that finds a rich patch of flowers tells her sisters where it is by dancing on"
    " the comb in the dark hive.\n\nThe other bees follow the dancer closely and learn from "
    "her movements.",
    "For nearby flowers the bee performs a round dance, circling one way and then the other. "
    "It says only that food is close to the hive.\n\nThe scent on her body tells which flowers"
    " to seek.",
    "For distant flowers she performs the waggle dance. She runs straight while shaking her "
    "body, then circles back and repeats.\n\nThe angle of the straight run from vertical gives"
    " the direction of the food relative to the sun.",
    "The length of the waggle run tells the distance to the flowers. A longer run means food "
    "farther away.\n\nThe dance language was first decoded by the scientist Karl von Frisch.",
]
_SWARMING = [
    "Swarming is how a colony reproduces. In late spring the old queen leaves the hive with "
    "about half of the workers.\n\nThe swarm forms a hanging cluster on a branch near the "
    "hive.",
    "Before a swarm leaves, the workers raise several new queens in swarm cells. The first "
    "new queen to emerge usually kills her rivals.\n\nShe then takes over the old hive and the"
    " bees that stayed behind.",
    "Scout bees from the cluster search for a new home. They report hollows by dancing on the"
    " surface of the swarm.\n\nWhen enough scouts agree on one site, the whole swarm flies "
    "there together.",
    "Beekeepers try to prevent swarming because it halves the honey crop. They give colonies "
    "more room and remove queen cells.\n\nA swarm that does leave can often be caught in a box"
    " and housed in a new hive.",
]
_WINTER_AND_DISEASE = [
    "In winter the bees form a tight cluster on the comb. They shiver their flight muscles to"
    " keep the centre of the cluster warm.\n\nThe bees on the outside slowly rotate inward to "
    "share the heat.",
    "A colony needs about twenty kilograms of honey to last the winter. It also needs a young"
    " queen and healthy bees.\n\nOn mild days the bees fly out briefly to relieve themselves.",
    "The varroa mite is the most serious pest of honey bees. It feeds on the larvae and adult"
    " bees and spreads viruses among them.\n\nMost colonies die within a few years if varroa "
    "is not controlled.",
    "Foulbrood is a bacterial disease that kills the larvae in their cells. Its spores last "
    "for decades in old comb.\n\nBeekeepers must inspect their brood often and burn infected "
    "combs to stop its spread.",
]
CHAPTERS: list[tuple[str, list[str]]] = [
    ("The colony", _THE_COLONY),
    ("The queen", _THE_QUEEN),
    ("Workers", _WORKERS),
    ("Drones", _DRONES),
    ("Honey", _HONEY),
    ("Pollen and pollination", _POLLEN_AND_POLLINATION),
    ("Wax and comb", _WAX_AND_COMB),
    ("The dance language", _THE_DANCE_LANGUAGE),
    ("Swarming", _SWARMING),
    ("Winter and disease", _WINTER_AND_DISEASE),
]
PAGES: list[str] = [page for _, pages in CHAPTERS for page in pages]


def sample_pdf() -> bytes:
    """The document as a text PDF: a title line on the first page, one page per entry of
    `PAGES`, an outline entry at the start of each chapter."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_title(TITLE)
    for number, (title, pages) in enumerate(CHAPTERS, start=1):
        for index, text in enumerate(pages):
            pdf.add_page()
            if index == 0:
                pdf.start_section(f"{number}. {title}")
                pdf.set_font("helvetica", style="B", size=16)
                pdf.multi_cell(0, 10, f"Chapter {number}: {title}")
                pdf.ln(4)
            pdf.set_font("helvetica", size=12)
            for paragraph in text.split("\n\n"):
                pdf.multi_cell(0, 7, paragraph)
                pdf.ln(5)
    return bytes(pdf.output())
