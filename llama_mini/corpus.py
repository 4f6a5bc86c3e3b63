"""The embedded default corpus: simple English stories, generated deterministically.

Training needs text, and downloading some is not allowed, so the package writes its own,
in the spirit of TinyStories: short stories with named characters who keep their names
and pronouns, places, dialogue with varied speech tags, and plots built from cause and
effect (the kite sticks in a tree *because* the wind blew; the friend helps, *so* ...).
A small model learns the grammar within minutes and then the habit of reusing a name it
has seen earlier in the story, which is the first sign of in-context learning.

Every story draws its choices from one random.Random seeded by (seed, story index), so the
corpus is identical on every machine and Python version. `python -m llama_mini.corpus
FILE` writes it to a file to read or to edit.
"""

import random
import sys

# --- Who, where and what -------------------------------------------------------------------

GIRLS = (
    "Lily Mia Emma Sophie Lucy Anna Ella Zoe Grace Ruby Chloe Amy Hannah Rosa Nina Maya Sara "
    "Kate Julia Ivy Lena Clara Alice Daisy Molly Ellie Nora Iris Hazel Olive Freya Leah Tara "
    "Aisha Priya Mei Yuki Elena Fatima Ingrid Wendy Poppy Matilda Beatrice Penny Gemma Rita"
).split()
BOYS = (
    "Tom Ben Max Sam Leo Jack Finn Oliver Noah Jake Tim Ryan Owen Luke Adam Eli Hugo Theo "
    "Oscar Felix Henry Jonah Milo Ravi Omar Kai Luca Ezra Ned Arlo Toby Dev "
    "Kenji Mateo Tariq Ivan Louis Peter George Arthur Rufus Simon Walter Jasper Harry Carlos"
).split()
PET_NAMES = (
    "Pip Bella Coco Rusty Buttons Pepper Biscuit Hoppy Whiskers Nutmeg Sunny Bubbles Dot Ziggy "
    "Patch Honey Fluffy Socks Ginger Misty Pickles Bramble Clover Acorn Pebble Maple Snowy Bolt "
    "Willow Thistle Noodle Pumpkin Cinnamon Sprout Juniper Puddle Marigold Flick Sparky Tuffy"
).split()
ADULTS = (  # (name, pronoun) for grown-ups who help or warn
    ("Mr. Brown", "he"), ("Mrs. Green", "she"), ("old Mr. Jones", "he"), ("Miss Rose", "she"),
    ("Mrs. Patel", "she"), ("Mr. Lee", "he"), ("Granny Joan", "she"), ("Farmer Dan", "he"),
    ("Mrs. Olsen", "she"), ("Captain Bill", "he"), ("Doctor Ada", "she"), ("Uncle Raj", "he"),
)
# Animal heroes: (kind, home).
ANIMALS = (
    ("bunny", "in a cozy burrow under an old oak tree"), ("fox", "in a den at the edge of the forest"),
    ("bear", "in a big cave on the side of a hill"), ("mouse", "in a tiny hole behind the kitchen wall"),
    ("duck", "in the tall reeds beside a quiet pond"), ("kitten", "in a warm basket by the fire"),
    ("puppy", "in a red kennel in the backyard"), ("squirrel", "in a nest high up in a pine tree"),
    ("owl", "in a hollow of an ancient tree"), ("frog", "on a lily pad in the middle of the pond"),
    ("hedgehog", "under a pile of dry leaves in the garden"), ("turtle", "on a sunny rock by the river"),
    ("pig", "in a muddy pen on a busy farm"), ("goat", "on a rocky hill above the village"),
    ("lamb", "in a green field full of daisies"), ("otter", "in a snug home on the riverbank"),
    ("penguin", "on a cold white island far away"), ("little dragon", "in a cave full of shiny stones"),
    ("robin", "in a nest of twigs on a garden fence"), ("raccoon", "in a hollow log near the campsite"),
)
CHILD_HOMES = (
    "in a small house near the park", "in a yellow house at the end of the street",
    "on a farm with many animals", "in a flat above a bakery", "in a village by the sea",
    "in a little cottage at the edge of the woods", "in a tall building in a busy city",
    "in a blue house with a big garden", "in a quiet town between two hills",
)
ADJECTIVES = (
    "little curious brave kind shy happy clever cheerful friendly gentle playful funny quiet "
    "busy careful helpful silly proud sleepy bright polite honest generous stubborn grumpy "
    "lively bold young thoughtful noisy clumsy patient gentle smart loyal modest cheeky "
    "dreamy jolly merry tidy messy adventurous timid hungry nosy"
).split()
HOBBIES = (  # (to ..., ...ing)
    ("play with blocks", "playing with blocks"), ("draw pictures", "drawing pictures"),
    ("sing songs", "singing songs"), ("dance in the kitchen", "dancing in the kitchen"),
    ("read books about ships", "reading books about ships"), ("build sandcastles", "building sandcastles"),
    ("climb trees", "climbing trees"), ("ride a bike", "riding a bike"),
    ("paint with bright colors", "painting with bright colors"),
    ("jump in puddles", "jumping in puddles"), ("look at the stars", "looking at the stars"),
    ("collect shiny stones", "collecting shiny stones"), ("bake cookies", "baking cookies"),
    ("play hide and seek", "playing hide and seek"), ("swim in the lake", "swimming in the lake"),
    ("run as fast as the wind", "running as fast as the wind"), ("tell silly jokes", "telling silly jokes"),
    ("make music with pots and pans", "making music with pots and pans"), ("plant flowers", "planting flowers"),
    ("watch the birds", "watching the birds"), ("skip rope", "skipping rope"),
    ("count the clouds", "counting the clouds"),
    ("fly paper planes", "flying paper planes"), ("dig for treasure", "digging for treasure"),
    ("play the violin", "playing the violin"), ("write little poems", "writing little poems"),
    ("knit colorful socks", "knitting colorful socks"), ("catch butterflies in a net", "catching butterflies in a net"),
    ("roll down grassy hills", "rolling down grassy hills"), ("feed the ducks", "feeding the ducks"),
    ("make funny faces in the mirror", "making funny faces in the mirror"),
    ("explore the attic", "exploring the attic"),
)
PARENTS = ("mom", "dad", "grandma", "grandpa", "big sister", "big brother", "aunt", "uncle")
PLACES = {  # where a scene happens: (phrase, things to see there)
    "park": ("in the park", ("swings", "a long slide", "old benches", "ducks on the water", "a big oak tree")),
    "beach": ("at the beach", ("warm sand", "pretty shells", "small crabs", "loud seagulls", "foamy waves")),
    "forest": ("in the forest", ("tall trees", "soft moss", "wild mushrooms", "a shy deer", "a winding path")),
    "river": ("by the river", ("smooth pebbles", "a wooden bridge", "jumping fish", "tall reeds", "a little boat")),
    "farm": ("on the farm", ("a red barn", "noisy chickens", "fat cows", "golden hay", "a muddy tractor")),
    "garden": ("in the garden", ("red roses", "busy bees", "a vegetable patch", "a stone path", "a bird bath")),
    "meadow": ("in the meadow",
        ("yellow flowers", "tall grass", "buzzing insects", "white butterflies", "a lonely rock")),
    "hill": ("on the hill", ("a windmill", "sheep", "a view of the town", "wild berries", "a cold wind")),
    "playground": ("at the playground",
        ("a sandpit", "a climbing frame", "a merry-go-round", "children laughing", "a seesaw")),
    "market": ("at the market",
        ("fresh bread", "piles of fruit", "busy people", "a man selling hats", "colorful flags")),
    "lake": ("near the lake", ("clear water", "green frogs", "a little dock", "white swans", "dragonflies")),
    "zoo": ("at the zoo", ("a tall giraffe", "sleepy lions", "cheeky monkeys", "a huge elephant", "pink flamingos")),
    "orchard": ("in the orchard",
        ("apple trees", "a wooden ladder", "baskets of pears", "fallen leaves", "a hungry goat")),
    "harbor": ("at the harbor", ("fishing boats", "thick ropes", "crying gulls", "a lighthouse", "nets full of fish")),
    "library": ("at the library",
        ("tall shelves", "quiet readers", "a sleepy librarian", "old maps", "a reading corner")),
    "mountain": ("on the mountain", ("snowy peaks", "a rushing waterfall", "a narrow trail", "eagles", "pine cones")),
    "fair": ("at the fair", ("a big wheel", "candy floss", "a carousel", "balloons", "a juggler")),
    "island": ("on the little island", ("palm trees", "a sandy cove", "a hidden cave", "turtles", "coconuts")),
    "school": ("at school", ("a big blackboard", "paint pots", "a class hamster", "a globe", "a busy hall")),
}
OBJECTS = (  # (name, adjectives, tags): the tags say which mishaps can happen to it
    ("ball", ("red", "bouncy", "striped", "new"), {"rolls", "floats"}),
    ("kite", ("colorful", "paper", "diamond", "dragon"), {"flies"}),
    ("hat", ("straw", "blue", "woolly", "funny"), {"flies", "floats"}),
    ("teddy bear", ("brown", "soft", "old", "fluffy"), {"drops"}),
    ("toy boat", ("wooden", "little", "green", "shiny"), {"floats"}),
    ("balloon", ("yellow", "big", "round", "purple"), {"flies"}),
    ("scarf", ("long", "warm", "rainbow", "silk"), {"flies", "drops"}),
    ("marble", ("glass", "tiny", "sparkly", "blue"), {"rolls", "drops"}),
    ("toy car", ("fast", "red", "tiny", "racing"), {"rolls", "drops"}),
    ("necklace", ("silver", "pretty", "beaded", "golden"), {"drops"}),
    ("book", ("favorite", "picture", "thick", "library"), {"drops"}),
    ("whistle", ("silver", "loud", "little", "wooden"), {"drops"}),
    ("rubber duck", ("yellow", "squeaky", "little", "happy"), {"floats"}),
    ("paper plane", ("white", "fast", "folded", "paper"), {"flies"}),
    ("umbrella", ("spotted", "black", "small", "bright"), {"flies"}),
    ("key", ("brass", "old", "tiny", "magic"), {"drops"}),
    ("sock monkey", ("floppy", "stripy", "handmade", "old"), {"drops", "floats"}),
    ("drum", ("toy", "noisy", "tin", "painted"), {"rolls"}),
)
MISHAPS = {  # tag -> (what happened, how the friend got it back)
    "rolls": (
        ("rolled down the hill and into the bushes", "crawled under the thorny branches"),
        ("bounced away and rolled under a fence", "reached under it with a long stick"),
        ("rolled into a deep ditch", "climbed down carefully and climbed back up"),
    ),
    "floats": (
        ("fell into the pond and floated away", "used a long branch to pull it back"),
        ("dropped into the river and drifted off", "ran along the bank and caught it with a net"),
    ),
    "flies": (
        ("was blown up into a tall tree", "climbed up the branches one by one"),
        ("was carried away by the wind and landed on a roof", "fetched a ladder and climbed up"),
        ("got caught on the top of a lamp post", "shook the post until it fell down"),
    ),
    "drops": (
        ("slipped into a hole in the ground", "lay on the grass and reached deep inside"),
        ("fell behind a heavy box in the shed", "pushed the box away together"),
        ("was picked up by a cheeky magpie and carried to its nest", "traded a shiny button for it"),
    ),
}
FOODS = (
    "apples cookies sandwiches berries carrots muffins pancakes cherries grapes plums peaches "
    "strawberries biscuits cupcakes oranges pears nuts crackers blueberries raspberries "
    "waffles dumplings pretzels lemons tangerines donuts tomatoes"
).split()
SPEECH_TAGS = {  # by the line's last character
    ".": ("said", "replied", "whispered", "answered", "sighed", "explained", "added", "murmured"),
    "?": ("asked", "wondered", "asked", "asked"),
    "!": ("shouted", "cried", "called", "laughed", "exclaimed", "yelled", "giggled"),
}
WEATHER = (
    "The sun was shining and the sky was blue.", "Big grey clouds covered the sky.",
    "A cool wind was blowing through the trees.", "It was a warm and lazy summer day.",
    "Snow had fallen in the night, and everything was white.", "The air smelled of rain and wet grass.",
    "It was a crisp autumn morning, and the leaves were red and gold.", "Little white clouds drifted across the sky.",
    "A thick fog hid the houses, and everything was silent.", "The puddles were frozen and sparkled like glass.",
    "It was so hot that even the dogs were resting in the shade.", "A gentle breeze carried the smell of flowers.",
)
TIMES = (
    "One morning", "One sunny day", "One rainy afternoon", "One cold winter morning", "Early one spring morning",
    "One summer evening", "On a windy autumn day", "One bright morning", "Last Saturday", "One quiet Sunday",
    "On Monday", "One foggy morning", "One snowy day", "After lunch one day", "One warm afternoon",
)


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def pronouns(he: str, prefix: str = "") -> dict:
    """The pronoun slots of one character: {he} {him} {his} {himself} {He} {His}..., or
    {fhe} {fhim}... with prefix "f"."""
    forms = {"he": ("he", "him", "his", "himself"), "she": ("she", "her", "her", "herself")}[he]
    slots = dict(zip(("he", "him", "his", "himself"), forms))
    slots.update({k.capitalize(): v.capitalize() for k, v in slots.items()})
    return {prefix + k: v for k, v in slots.items()}


class Story:
    """One story being written: the cast in self.slots, the text in self.paragraphs.

    Templates name slots like {hero}, {his}, {friend}, {fhe} (the friend's pronoun) and
    {obj}; one template is chosen at random from the alternatives for every sentence, so
    the same plot comes out in many different wordings.
    """

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.paragraphs: list[list[str]] = [[]]
        animal = rng.random() < 0.35
        if animal:
            kind, home = rng.choice(ANIMALS)
            name = rng.choice(PET_NAMES)
            he = rng.choice(("he", "she"))
        else:
            he = rng.choice(("he", "she"))
            kind = "girl" if he == "she" else "boy"
            name = rng.choice(GIRLS if he == "she" else BOYS)
            home = rng.choice(CHILD_HOMES)
        fhe = rng.choice(("he", "she"))
        friend = rng.choice([n for n in (PET_NAMES if animal else GIRLS if fhe == "she" else BOYS) if n != name])
        fkind = rng.choice(ANIMALS)[0] if animal else ("girl" if fhe == "she" else "boy")
        adult, ahe = rng.choice(ADULTS)
        place = rng.choice(list(PLACES))
        phrase, sights = PLACES[place]
        sight, sight2 = rng.sample(sights, 2)
        hobby, hobby_ing = rng.choice(HOBBIES)
        self.slots = dict(
            hero=name, kind=kind, home=home, adj=rng.choice(ADJECTIVES), friend=friend, fkind=fkind,
            fadj=rng.choice(ADJECTIVES), adult=adult, parent=rng.choice(PARENTS), place=place, at_place=phrase,
            sight=sight, sight2=sight2, hobby=hobby, hobby_ing=hobby_ing,
            food=rng.choice(FOODS), time=rng.choice(TIMES), weather=rng.choice(WEATHER),
            **pronouns(he), **pronouns(fhe, "f"), **pronouns(ahe, "a"),
        )
        self.slots["a_adj"] = article(self.slots["adj"])
        self.slots["a_fadj"] = article(self.slots["fadj"])

    def pick(self, options):
        return self.rng.choice(options)

    def say(self, *templates: str) -> None:
        """Add one sentence, chosen among templates, with its slots filled in."""
        text = self.pick(templates).format_map(self.slots)
        self.paragraphs[-1].append(text[0].upper() + text[1:])

    def quote(self, speaker: str, *lines: str, tag: str | None = None) -> None:
        """A line of dialogue: "Words," said Name. The speech tag fits the punctuation."""
        line = self.pick(lines).format_map(self.slots)
        tag = tag or self.pick(SPEECH_TAGS[line[-1]])
        who = speaker.format_map(self.slots)
        if line.endswith("."):
            line = line[:-1] + ","
        self.paragraphs[-1].append(f'"{line}" {tag} {who}.')

    def paragraph(self) -> None:
        if self.paragraphs[-1]:
            self.paragraphs.append([])

    def text(self) -> str:
        return "\n".join(" ".join(p) for p in self.paragraphs if p)


# --- Beginnings and endings --------------------------------------------------------------------


def introduce(st: Story) -> None:
    st.say(
        "Once upon a time, there was {a_adj} {kind} named {hero}.",
        "Once upon a time, {a_adj} {kind} called {hero} lived {home}.",
        "There once was {a_adj} {kind} named {hero} who lived {home}.",
        "{hero} was {a_adj} {kind} who lived {home}.",
        "{time}, {a_adj} {kind} named {hero} woke up and looked out of the window.",
    )
    st.say(
        "{He} loved to {hobby}.", "More than anything, {he} liked {hobby_ing}.",
        "{He} spent every afternoon {hobby_ing}.", "{He} was very good at {hobby_ing}.",
        "Every day, {he} liked to {hobby} with {his} {parent}.",
    )
    st.say(
        "{His} best friend was {friend}, {a_fadj} {fkind}.",
        "{hero} had a friend named {friend}, who was {a_fadj} {fkind}.",
        "{friend}, {a_fadj} {fkind}, was {his} best friend in the whole world.",
    )


def end(st: Story, lesson: str) -> None:
    st.paragraph()
    st.say(
        "From that day on, {hero} " + lesson + ".", "After that, {hero} always " + lesson + ".",
        "{hero} learned an important lesson that day, and {he} always " + lesson + ".",
    )
    st.say(
        "That night, {hero} went to bed with a big smile on {his} face.", "It had been the best day ever.",
        "{hero} was happy, because {he} knew {he} had done the right thing.", "So {hero} smiled all the way home.",
        "And {hero} and {friend} stayed the best of friends.", "The end.", "{hero} felt warm and happy inside.",
    )


# --- Plots: each one is a chain of causes and effects ---------------------------------------------


def lost_toy(st: Story) -> None:
    name, adjectives, tags = st.pick(OBJECTS)
    what, fix = st.pick(MISHAPS[st.pick(sorted(tags))])
    st.slots.update(obj=name, obj_adj=st.pick(adjectives), what=what, fix=fix)
    st.say(
        "{hero} had a {obj_adj} {obj} that {his} {parent} had given {him}.",
        "{hero}'s favorite thing in the world was {his} {obj_adj} {obj}.",
        "For {his} birthday, {hero} got a {obj_adj} {obj}, and {he} took it everywhere.",
    )
    st.paragraph()
    st.say("{time}, {hero} and {friend} went to play {at_place}.", "{time}, {hero} took the {obj} to play {at_place}.",
           "{time}, the sky was so clear that {hero} took the {obj} {at_place}.")
    st.say("{weather}", "There were {sight} and {sight2} everywhere.", "{He} saw {sight} and {sight2}.")
    st.say(
        "But then the {obj} {what}!", "Suddenly, the {obj} {what}.",
        "{hero} was not careful, and the {obj} {what}.",
    )
    st.say(
        "{hero} was very sad, because {he} loved that {obj}.", "{hero} began to cry.",
        "{hero} felt a big lump in {his} throat.", "Because it was {his} favorite thing, {hero} could not stop crying.",
    )
    st.paragraph()
    st.quote(
        "{hero}", "My {obj}! I will never get it back!", "Oh no! What am I going to do?", "Can you help me, {friend}?",
    )
    st.quote(
        "{friend}", "Don't worry, {hero}. I have an idea.", "Don't cry. We can get it back together!", "Let's think.",
    )
    st.say(
        "So {friend} {fix}.", "So the two friends {fix}.",
        "{friend} was scared, but {fhe} {fix} anyway, because {fhe} wanted to help.",
    )
    st.say(
        "At last, the {obj} was safe.",
        "After a while, {friend} held up the {obj}.",
        "Finally, they got the {obj} back.",
    )
    st.quote(
        "{hero}", "Thank you, {friend}! You are the best friend ever!", "You saved my {obj}!", "Thank you so much!",
    )
    st.quote("{friend}", "That is what friends are for.", "I am happy I could help.", tag="said")
    end(
        st,
        st.pick(("held on tight to {his} {obj}", "kept {his} {obj} close", "remembered that friends help each other")),
    )


def sharing(st: Story) -> None:
    st.say(
        "{time}, {hero}'s {parent} gave {him} a basket of {food}.",
        "{time}, {hero} picked a big bag of {food} {at_place}.",
    )
    st.say("{He} did not want to share them with anyone.", "{He} wanted to eat them all by {himself}.")
    st.paragraph()
    st.say(
        "Then {friend} came by.",
        "Soon, {friend} walked up to {him}.",
        "{friend} was hungry, so {fhe} came over to {hero}.",
    )
    st.quote("{friend}", "Those {food} look yummy. Can I have one?", "May I have some {food}, please?")
    st.quote("{hero}", "No! They are all mine!", "No, go away. I want them all.", tag="said")
    st.say("{friend} was sad and walked away slowly.", "{friend}'s face fell, and {fhe} went home alone.")
    st.paragraph()
    st.say(
        "{hero} ate and ate until {his} tummy hurt.", "But eating alone was not fun at all.",
        "{hero} sat with {his} {food}, but {he} felt lonely.",
    )
    st.say(
        "Because {he} had eaten too many, {he} felt sick.", "{He} looked at the empty path and missed {his} friend.",
    )
    st.say(
        "{He} picked up the rest of the {food} and ran to find {friend}.",
        "So {he} went to {friend}'s house with the basket.",
    )
    st.quote("{hero}", "I am sorry, {friend}. Would you like to share my {food}?", "I was wrong. Let's share!")
    st.quote("{friend}", "Yes, please! Thank you, {hero}.", "I would love that!", tag="said")
    st.say(
        "They sat together and ate the {food}, and they laughed and talked.",
        "Sharing made the {food} taste even better.",
    )
    end(st, "shared with {his} friends")


def storm(st: Story) -> None:
    st.say(
        "{hero} and {friend} had planned a picnic {at_place}.", "{hero} wanted to go {at_place} with {friend} to play.",
    )
    st.say("{hero} packed {food}, a blanket and a ball.", "They were so excited that they could not sit still.")
    st.paragraph()
    st.say(
        "But just as they were ready to go, dark clouds filled the sky.",
        "But then the wind grew strong and it began to rain.",
        "Suddenly, there was a loud clap of thunder.",
    )
    st.say(
        "Because of the storm, they could not go outside.",
        "The rain was so heavy that the streets turned into rivers.",
    )
    st.quote("{hero}", "Now our day is ruined!", "This is not fair!", tag="cried")
    st.quote(
        "{his} {parent}",
        "Why don't you have your picnic inside?",
        "Sometimes plans change. Let's make a new plan.",
        tag="said",
    )
    st.paragraph()
    st.say(
        "So they spread the blanket on the living room floor.", "So they built a tent out of chairs and pillows.",
    )
    st.say(
        "They ate their {food} and listened to the rain on the roof.",
        "{friend} told stories, and {hero} laughed so hard {he} fell over.",
    )
    st.say(
        "When the storm was over, a rainbow appeared in the sky.",
        "Later, the sun came out and the puddles shone like mirrors.",
    )
    st.quote("{hero}", "This was the best picnic ever!", "Rainy days can be fun too!")
    end(st, "knew that a bad day could still turn out good")


def fear(st: Story) -> None:
    fears = (
        ("the dark", "turned off the light", "there was nothing scary in the dark at all"),
        ("the big slide", "climbed up the ladder and slid down", "the slide was fast and fun"),
        ("deep water", "put {his} feet in the water and began to swim", "the water held {him} up"),
        ("the old dog next door", "held out {his} hand to the dog", "the dog only wanted to play"),
        ("thunder", "listened to the storm without hiding", "thunder was just a loud noise"),
        ("riding {his} bike without help", "pushed the pedals by {himself}", "{he} could ride all alone"),
    )
    scary, act, truth = st.pick(fears)
    st.slots.update(scary=scary.format_map(st.slots))
    st.slots.update(act=act.format_map(st.slots), truth=truth.format_map(st.slots))
    st.say("But {hero} was afraid of {scary}.", "There was one thing {hero} did not like: {scary}.")
    st.say("Whenever {he} thought about it, {his} knees shook.", "{He} always hid behind {his} {parent} because of it.",
           "Because of this, {he} often stayed inside while the others played.")
    st.paragraph()
    st.quote("{hero}", "I can't do it. I am too scared.", "What if something bad happens?", tag="whispered")
    st.quote(
        "{his} {parent}",
        "Being brave does not mean you are not scared. It means you try anyway.",
        "I will be right here with you.",
        tag="said",
    )
    st.say("{hero} took a deep breath.", "{hero} held {his} {parent}'s hand tight and counted to three.")
    st.say("Then {he} {act}.", "Slowly, {he} {act}.")
    st.say("To {his} surprise, {truth}.", "Soon {he} saw that {truth}.")
    st.quote("{hero}", "I did it! I am not scared anymore!", "That was not so bad after all!", tag="shouted")
    st.say("{His} {parent} gave {him} a big hug.", "{friend} clapped and cheered for {him}.")
    end(st, "tried again when something felt scary")


def building(st: Story) -> None:
    things = (
        ("tree house", "boards and nails"), ("snowman", "snow, a carrot and two round stones"),
        ("raft", "sticks and string"), ("bird house", "wood and glue"), ("sandcastle", "sand, shells and water"),
        ("kite", "paper and thin sticks"), ("go-kart", "an old box and four wheels"),
        ("tower", "cardboard boxes and tape"),
        ("bridge", "stones and planks"), ("robot", "tin cans, wires and bottle caps"),
    )
    thing, stuff = st.pick(things)
    st.slots.update(thing=thing, stuff=stuff)
    st.say("{time}, {hero} decided to build a {thing}.", "{hero} wanted to make a {thing} all by {himself}.")
    st.say("{He} gathered {stuff} and got to work.", "{He} found {stuff} and started right away.")
    st.say(
        "But {he} was in a hurry, so {he} did not do it carefully.", "But {he} did not ask anyone for help.",
    )
    st.say("When {he} was almost done, it fell apart.", "Soon it wobbled, and then it broke into pieces.")
    st.say("{hero} felt angry and kicked the ground.", "{hero} sat down and wanted to give up.",
           "Because it had broken, {hero} felt like giving up.")
    st.paragraph()
    st.quote("{friend}", "Can I help you? Two can do more than one.", "Maybe we can try again together?")
    st.quote("{hero}", "All right. Let's try one more time.", "Yes, please. I could not do it alone.", tag="said")
    st.say(
        "This time they went slowly and worked as a team.",
        "This time {friend} held the pieces while {hero} fixed them.",
    )
    st.say("It took all afternoon, but it did not fall down.", "When they were finished, they stepped back to look.")
    st.say("It was the best {thing} they had ever seen.", "Their {thing} was strong and beautiful.")
    st.quote("{hero}", "We did it because we worked together!", "It is even better than I imagined!")
    end(st, "took {his} time and asked for help when {he} needed it")


def hurt_animal(st: Story) -> None:
    creatures = (
        ("a baby bird", "wing"), ("a little rabbit", "leg"), ("a tiny hedgehog", "paw"), ("a young deer", "leg"),
        ("a small duck", "wing"),
    )
    creature, part = st.pick(creatures)
    st.slots.update(creature=creature, part=part)
    st.say(
        "{time}, {hero} was walking {at_place} when {he} heard a soft cry.",
        "{time}, {hero} found {creature} {at_place}.",
    )
    st.say("It was {creature}, and it had a hurt {part}.", "The poor thing had hurt its {part} and could not move.")
    st.quote("{hero}", "Poor little thing. I will help you.", "Don't be afraid. I won't hurt you.", tag="whispered")
    st.say("{He} carried it home very gently.", "{He} wrapped it in {his} scarf and took it home.")
    st.paragraph()
    st.say(
        "{adult} knew a lot about animals, so {hero} asked {ahim} for help.",
        "{hero} showed it to {adult}, who lived next door.",
    )
    st.quote(
        "{adult}",
        "It needs rest, water and a little food. Can you look after it?",
        "If you keep it warm, it will get better.",
        tag="said",
    )
    st.say(
        "Every day, {hero} gave it water and {food}.",
        "{hero} made a bed for it in a shoe box and checked on it every morning.",
    )
    st.say(
        "Because {he} took such good care of it, its {part} healed.", "After a week, it could move its {part} again.",
    )
    st.paragraph()
    st.say("Then it was time to say goodbye.", "{hero} knew it belonged outside, so {he} took it back {at_place}.")
    st.say("{hero} felt sad, but also proud.", "{hero} waved as it went away.")
    st.say(
        "The next day, it came back to visit, as if to say thank you.", "Sometimes, {hero} still sees it {at_place}.",
    )
    end(st, "treated every animal gently")


def race(st: Story) -> None:
    st.say(
        "{hero} and {friend} decided to have a race {at_place}.",
        "{time}, {friend} asked {hero} to race across the {place}.",
    )
    st.quote("{hero}", "I am the fastest. I will win for sure!", "You can't beat me!", tag="said")
    st.say("They counted to three and started running.", "Ready, set, go! They ran as fast as they could.")
    st.say(
        "{hero} was so busy showing off that {he} did not look where {he} was going.",
        "{hero} looked back to laugh at {friend}.",
    )
    st.say(
        "{He} tripped over a stone and fell down.", "Because of that, {he} ran into a puddle and fell with a splash.",
    )
    st.say("{His} knee was scraped and it hurt.", "{He} was covered in mud from head to toe.")
    st.paragraph()
    st.say("{friend} could have won the race.", "{friend} was almost at the finish.")
    st.say("But {fhe} stopped and came back to help {hero}.", "Instead, {fhe} turned around and helped {hero} up.")
    st.quote("{friend}", "Are you okay? Let's finish together.", "Winning is not fun if my friend is hurt.", tag="said")
    st.say("They walked to the finish side by side.", "Holding hands, they crossed the line together.")
    st.quote(
        "{hero}", "I am sorry I was so proud. You are a true friend.", "Thank you. You are kinder than me.", tag="said",
    )
    end(st, "remembered that being kind is better than winning")


def surprise(st: Story) -> None:
    st.say("It was {hero}'s {parent}'s birthday.", "Tomorrow was a special day: it was {his} {parent}'s birthday.")
    st.say("{hero} wanted to make a surprise cake.", "{hero} and {friend} decided to bake a cake as a surprise.")
    st.say("They found flour, eggs, sugar and milk.", "They put on aprons and took out a big bowl.")
    st.paragraph()
    st.say(
        "But {friend} mixed too fast, and flour flew everywhere.",
        "But they dropped the eggs, and they broke on the floor.",
        "But they forgot to watch the oven, so the cake got a little burnt.",
    )
    st.say("The kitchen was a big mess.", "Soon there was flour on the table, on the floor and even on the cat.")
    st.quote("{hero}", "Oh no! The surprise is ruined!", "What will we do now?", tag="cried")
    st.say("Just then, {his} {parent} walked into the kitchen.", "At that moment, the door opened.")
    st.say("{hero} thought {his} {parent} would be angry.", "Everyone was very quiet.")
    st.paragraph()
    st.say("But {his} {parent} began to laugh.", "But {his} {parent} smiled a big smile.")
    st.quote(
        "{his} {parent}",
        "This is the best surprise I have ever had!",
        "A cake made with love is the best cake of all.",
        tag="said",
    )
    st.say(
        "They cleaned up together, and then they ate the cake.", "The cake was a little flat, but it tasted wonderful.",
    )
    end(st, "knew that love mattered more than a perfect cake")


def warning(st: Story) -> None:
    rules = (  # (the rule, why, what the hero did anyway, what happened)
        ("not to climb the old wall", "the stones were loose", "climbed up the old wall",
         "a stone slipped and {he} fell"),
        ("not to go near the pond alone", "the bank was slippery", "went to the pond alone",
         "{he} slipped and got all wet"),
        ("not to eat the green apples", "they were not ripe yet", "ate three green apples",
         "{he} got a terrible tummy ache"),
        ("not to play with the ball in the house", "something could break", "kicked the ball in the living room",
         "it hit a vase and the vase broke"),
        ("to wear {his} boots", "it was muddy outside", "went out in {his} new shoes",
         "{his} shoes got stuck in the mud"),
    )
    rule, why, did, result = st.pick(rules)
    st.slots.update(
        rule=rule.format_map(st.slots), why=why, did=did.format_map(st.slots), result=result.format_map(st.slots),
    )
    st.say(
        "{hero}'s {parent} told {him} {rule}, because {why}.",
        "{adult} always told the children {rule}, because {why}.",
    )
    st.say("But {hero} did not listen.", "{hero} nodded, but {he} was not really listening.")
    st.say("{time}, {he} {did}.", "When nobody was looking, {hero} {did}.")
    st.say("Then {result}.", "Sure enough, {result}.")
    st.paragraph()
    st.say("{hero} began to cry, and {his} {parent} came running.", "{friend} heard the noise and went to get help.")
    st.quote(
        "{hero}",
        "I am sorry. I should have listened to you.",
        "I did not listen, and now look what happened.",
        tag="said",
    )
    st.quote(
        "{his} {parent}",
        "I am glad you are safe. Rules are there to keep you safe.",
        "Everyone makes mistakes. What matters is that you learn.",
        tag="said",
    )
    st.say("{hero} helped to clean up the mess.", "{hero} thought about what had happened for a long time.")
    end(st, "listened when someone tried to keep {him} safe")


def mystery(st: Story) -> None:
    st.say(
        "{time}, {hero} baked some {food} and left them on the window sill to cool.",
        "{hero}'s {parent} put a plate of {food} on the table.",
    )
    st.say("But when {hero} came back, the {food} were gone!", "An hour later, the plate was empty!")
    st.quote("{hero}", "Who took my {food}?", "Somebody ate all the {food}!", tag="shouted")
    st.say("{hero} decided to be a detective.", "{hero} and {friend} wanted to solve the mystery.")
    st.paragraph()
    st.say("First they asked {adult}, but {ahe} had been asleep, so {ahe} had not seen anything.",
           "First they looked under the table, but there was nothing there.")
    st.say("Then they found crumbs on the floor.", "Then {friend} saw small muddy footprints.")
    st.quote("{friend}", "Look! Let's follow them!", "These go all the way to the garden!")
    st.say("The trail led to the garden shed.", "They followed the trail around the house.")
    st.say(
        "There they found a fat little dog with crumbs on its nose.", "There sat a puppy, licking its lips.",
        "There was a squirrel with its cheeks full of {food}.",
    )
    st.say("Everyone laughed, even {hero}.", "{hero} could not be angry, because it looked so happy.")
    st.quote("{hero}", "Next time I will bake some for you too.", "Mystery solved!", tag="laughed")
    end(st, "kept an eye on the window sill")


def garden(st: Story) -> None:
    plants = ("a sunflower", "a tomato plant", "an apple tree", "a pumpkin", "a rose bush", "some beans")
    st.slots.update(plant=st.pick(plants))
    st.say(
        "{time}, {hero}'s {parent} gave {him} a small seed.", "{hero} found a seed and wanted it to grow into {plant}.",
    )
    st.say(
        "{He} planted it in the soil and gave it water.",
        "{He} dug a little hole, put the seed inside and covered it up.",
    )
    st.say("The next morning, {he} ran outside to look.", "Every hour, {he} checked to see if it had grown.")
    st.say("But nothing had happened.", "But there was only brown earth.")
    st.quote("{hero}", "Why is it not growing?", "Is my seed broken?", tag="asked")
    st.quote(
        "{his} {parent}",
        "Seeds need sun, water and time. You have to be patient.",
        "Good things take time.",
        tag="said",
    )
    st.paragraph()
    st.say("So {hero} waited.", "So {hero} watered it every day and waited.")
    st.say("Days went by, and then weeks.", "The sun shone and the rain fell.")
    st.say("One day, a tiny green shoot poked out of the ground.", "At last, a small green leaf appeared.")
    st.say(
        "Because {he} had cared for it so well, it grew tall and strong.",
        "By the end of summer, it had become {plant}.",
    )
    st.quote("{hero}", "Look! It was worth the wait!", "I grew it myself!", tag="shouted")
    end(st, "waited patiently for good things to grow")


def trip(st: Story) -> None:
    st.say(
        "{time}, {hero}'s {parent} took {him} and {friend} on a trip {at_place}.",
        "{hero} had never been to the {place} before.",
    )
    st.say("{weather}", "On the way, they sang songs and counted cows.")
    st.say("When they arrived, {hero}'s eyes grew wide.", "It was even better than {hero} had imagined.")
    st.say("There were {sight} and {sight2}.", "First they saw {sight}, and then they saw {sight2}.")
    st.paragraph()
    st.say(
        "Then {hero} wandered off to look at the {sight2}.",
        "But {hero} walked too far and could not see {his} {parent} anymore.",
    )
    st.say(
        "{He} was lost!",
        "{He} looked left and right, but everyone was a stranger.",
        "Because {he} had not stayed close, {he} was lost.",
    )
    st.say(
        "{He} remembered what {his} {parent} had said: stay where you are and ask a helper.",
        "{He} took a deep breath and did not run away.",
    )
    st.say("{He} found {adult}, who had a kind face.", "{He} asked {adult} for help.")
    st.quote(
        "{adult}", "Don't worry. We will find your {parent} together.", "Stay with me. I will help you.", tag="said",
    )
    st.say(
        "Soon {hero} heard {his} {parent} calling {his} name.",
        "A few minutes later, {hero} saw {his} {parent} and {friend} running towards {him}.",
    )
    st.say("{hero} ran into {his} {parent}'s arms.", "They hugged for a long time.")
    end(st, "stayed close to {his} {parent} in new places")


def new_friend(st: Story) -> None:
    he = st.pick(("he", "she"))
    newcomer = st.pick([n for n in (BOYS if he == "he" else GIRLS) if n not in (st.slots["hero"], st.slots["friend"])])
    st.slots.update(new=newcomer, **pronouns(he, "n"))
    st.say(
        "{time}, a new family moved into the house across the street.", "{time}, a new child came to {hero}'s class.",
    )
    st.say("Their child was called {new}.", "The teacher said that {nhis} name was {new}.")
    st.say("{new} looked shy and stood alone all morning.", "{new} did not know anyone, so {nhe} sat by {nhimself}.")
    st.say("{hero} remembered how it felt to be new.", "{hero} saw that {new} looked lonely.",
           "{hero} knew it was hard to be new, because {he} had moved once too.")
    st.paragraph()
    st.quote(
        "{hero}", "Hello, {new}! Do you want to play with us?", "Hi, I am {hero}. Would you like to {hobby} with me?",
    )
    st.quote("{new}", "Yes, please! I don't have any friends here yet.", "Really? Thank you!", tag="said")
    st.say(
        "So {hero}, {friend} and {new} played together all afternoon.",
        "{hero} showed {new} how to {hobby}, and {new} learned fast.",
    )
    st.say("{new} knew a lot of funny games from {nhis} old town.", "It turned out that {new} loved {hobby_ing} too.")
    st.say("When it was time to go home, {new} was smiling from ear to ear.", "Soon, {new} was laughing with everyone.")
    question, answer = st.pick((
        ("Can we play again tomorrow?", "Yes, every day if you like!"),
        ("Today was the best day since we moved here!", "I am glad you came. You are our friend now."),
    ))
    st.quote("{new}", question)
    st.quote("{hero}", answer, tag="said")
    end(st, "looked out for anyone who was alone")


def honesty(st: Story) -> None:
    precious = ("vase", "lamp", "teapot", "clock", "mirror", "cup", "picture frame", "flower pot")
    st.slots.update(thing=st.pick(precious))
    st.say(
        "{hero}'s {parent} had a beautiful old {thing}.",
        "On the shelf stood the {thing} that {hero}'s {parent} loved most.",
    )
    st.say("{time}, {hero} was {hobby_ing} in the house.", "{time}, {hero} was playing with a ball inside.")
    st.say(
        "{He} bumped into the shelf, and the {thing} fell and broke.",
        "Crash! The {thing} fell to the floor and broke into pieces.",
    )
    st.say(
        "{hero} was scared that {he} would be in trouble.",
        "{hero}'s heart beat fast, because {he} knew it was special.",
    )
    st.paragraph()
    st.say(
        "When {his} {parent} came in, {hero} said that the cat had done it.",
        "{hero} hid the pieces under the sofa and said nothing.",
    )
    st.say("But that night {he} could not sleep.", "But the lie felt heavy, like a stone in {his} tummy.")
    st.say("{He} knew that telling the truth was the right thing to do.", "{He} did not like keeping a secret.")
    st.say(
        "So {he} got up and went to find {his} {parent}.",
        "In the morning, {he} went to {his} {parent} with tears in {his} eyes.",
    )
    st.quote(
        "{hero}", "I broke the {thing}, and I did not tell the truth. I am sorry.", "It was me. I broke the {thing}.",
    )
    st.quote(
        "{his} {parent}",
        "Thank you for telling me. Things can be fixed, but trust is worth more.",
        "I am proud of you for being honest.",
        tag="said",
    )
    st.say(
        "Together they glued the pieces back together.",
        "The {thing} was never quite the same, but {hero} felt light again.",
    )
    end(st, "told the truth, even when it was hard")


def magic(st: Story) -> None:
    charms = ("a glowing stone", "a silver feather", "a shell that hummed", "a tiny golden bell", "an old brass lamp")
    wishes = (
        ("to fly like a bird", "{he} floated up into the sky", "{he} got stuck on top of a church tower"),
        ("for a mountain of candy", "candy rained down from the sky", "{he} ate so much that {he} felt sick"),
        ("to be as big as a giant", "{he} grew taller than the houses", "{he} could not fit through {his} own door"),
        ("for it to be summer forever", "the sun shone and shone", "the flowers dried up and the river got low"),
        ("to never go to bed", "the night never came", "{he} became so tired that nothing was fun anymore"),
    )
    charm = st.pick(charms)
    wish, happened, problem = st.pick(wishes)
    st.slots.update(charm=charm, wish=wish.format_map(st.slots))
    st.slots.update(happened=happened.format_map(st.slots), problem=problem.format_map(st.slots))
    st.say("{time}, {hero} found {charm} {at_place}.", "While {hobby_ing}, {hero} found {charm} hidden under a leaf.")
    st.say(
        "When {he} picked it up, it began to sparkle.",
        "It was warm, and it shimmered with every color of the rainbow.",
    )
    st.quote(
        "a small voice",
        "You may have one wish, but choose wisely.",
        "Make a wish, and it will come true.",
        tag="whispered",
    )
    st.say("{hero} did not stop to think, and wished {wish}.", "Without thinking, {hero} wished {wish}.")
    st.paragraph()
    st.say("At once, {happened}.", "In a flash, {happened}.")
    st.say(
        "At first it was wonderful.", "{hero} laughed and clapped {his} hands, because it was just what {he} wanted.",
    )
    st.say("But soon {problem}.", "But after a while, {problem}.")
    st.quote("{hero}", "I want everything to be normal again!", "Please, I wish I had never made that wish!")
    st.say(
        "The magic glowed one last time, and everything went back to how it was.",
        "There was a soft pop, and everything was just as before.",
    )
    st.say(
        "{hero} ran home and hugged {his} {parent}.",
        "{hero} told {friend} the whole story, but {fhe} did not believe a word.",
    )
    end(st, "thought carefully before wishing for anything")


def helping_neighbor(st: Story) -> None:
    troubles = (
        ("could not carry {ahis} heavy bags up the hill", "carried the bags all the way home"),
        ("had lost {ahis} glasses", "searched the whole garden and found them in a flower bed"),
        ("was too sick to walk {ahis} dog", "walked the dog every morning for a week"),
        ("could not reach the apples on {ahis} tree", "climbed the ladder and picked a whole basket"),
        ("had a broken fence, and the chickens kept running away", "caught the chickens and helped mend the fence"),
    )
    trouble, helped = st.pick(troubles)
    st.slots.update(trouble=trouble.format_map(st.slots), helped=helped)
    st.say("{adult} lived next door to {hero}.", "{adult} was very old and lived all alone.")
    st.say("{time}, {hero} saw that {adult} {trouble}.", "{time}, {hero} noticed that {adult} {trouble}.")
    st.say(
        "{hero} wanted to go and play, but {he} stopped.",
        "{friend} was waiting for {him} {at_place}, but {hero} thought for a moment.",
    )
    st.quote("{hero}", "Can I help you, {adult}?", "Do you need some help?")
    st.quote(
        "{adult}",
        "Oh, that would be very kind of you.",
        "Thank you, my dear. My old legs are very tired today.",
        tag="said",
    )
    st.paragraph()
    st.say("So {hero} {helped}.", "{hero} and {friend} {helped}.")
    st.say("It was hard work, and {hero} got very hot.", "It took a long time, but {hero} did not give up.")
    st.say(
        "When they were done, {adult} gave {him} a jar of honey and a big smile.",
        "To say thank you, {adult} baked {him} a tray of {food}.",
    )
    st.say(
        "{adult} also told {him} stories about when {ahe} was a child.",
        "{hero} felt proud, because {he} had made someone happy.",
    )
    end(st, "helped {adult} whenever {he} could")


PLOTS = (
    lost_toy, sharing, storm, fear, building, hurt_animal, race, surprise, warning, mystery, garden, trip,
    new_friend, honesty, magic, helping_neighbor,
)


def story(seed: int, index: int) -> str:
    """Story number index of the corpus with this seed: the same text on every machine."""
    st = Story(random.Random(f"{seed}:{index}"))
    introduce(st)
    st.paragraph()
    st.pick(PLOTS)(st)
    return st.text()


def stories(n_chars: int = 2_200_000, seed: int = 0) -> list[str]:
    """Stories until their total length reaches n_chars (2.2 MB by default)."""
    out, total = [], 0
    while total < n_chars:
        out.append(story(seed, len(out)))
        total += len(out[-1]) + 2
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m llama_mini.corpus OUT.txt")
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        f.write("\n\n".join(stories()) + "\n")
