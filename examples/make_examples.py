"""Write the example corpus: python examples/make_examples.py (deterministic; output is committed).

Reviews and products are assembled from hand-written phrases so the texts read like real
cell-phone-accessory reviews; faults.jsonl is written byte by byte (BOM, CRLF, bad UTF-8...).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
CATEGORY = "Cell Phones & Accessories"

# (kind, category path, name patterns, features, good points, bad points)
KINDS = {
    "case": (
        ["Cases, Holsters & Sleeves", "Basic Cases"],
        ["{brand} Slim Shockproof Case for iPhone 15", "{brand} Clear Case for Galaxy S24 Ultra", "{brand} Rugged Armor Case for Pixel 8"],
        ["Military-grade drop protection", "Raised edges protect camera and screen", "Precise cutouts for all ports"],
        ["fits like a glove", "survived a drop onto concrete without a scratch", "the buttons are clicky and easy to press", "it doesn't add much bulk at all", "the grip on the sides keeps it from sliding off the couch"],
        ["the clear back yellowed after a month", "the edges started peeling", "it's hard to get off when you want to clean it", "the camera cutout is slightly off", "it attracts lint in my pocket"],
    ),
    "charger": (
        ["Chargers & Power Adapters", "Wall Chargers"],
        ["{brand} 20W USB-C Fast Wall Charger", "{brand} 65W GaN 3-Port Charger", "{brand} Dual USB Wall Plug, 2-Pack"],
        ["PD 3.0 fast charging", "Foldable prongs for travel", "Over-heat and over-current protection"],
        ["charges my phone from 10% to 60% in about half an hour", "it's tiny, I keep one in my backpack", "runs my laptop and phone at the same time", "doesn't get hot even overnight"],
        ["it gets really warm when charging two devices", "one of the ports stopped working after six weeks", "it buzzes faintly at night", "the prongs wobble in the outlet"],
    ),
    "cable": (
        ["Cables", "Lightning Cables"],
        ["{brand} Braided USB-C to USB-C Cable 6ft", "{brand} Lightning Cable 3-Pack, MFi Certified", "{brand} Right Angle Charging Cable 10ft"],
        ["Nylon braided jacket", "Tested to 20,000 bends", "Supports 60W charging and data sync"],
        ["the braiding feels tough", "10 feet is perfect for reaching the bed", "transfers photos to my laptop quickly", "the connector clicks in firmly"],
        ["the connector frayed near the plug", "it only charges if you hold it at an angle", "my phone says accessory not supported", "the braiding came apart at the end"],
    ),
    "protector": (
        ["Screen Protectors"],
        ["{brand} Tempered Glass Screen Protector for iPhone 14, 3 Pack", "{brand} Privacy Screen Protector for Galaxy S23", "{brand} Matte Anti-Glare Film for iPad"],
        ["9H hardness", "Installation frame included", "Bubble-free adhesive"],
        ["the alignment frame made installation foolproof", "no bubbles at all", "touch sensitivity is exactly the same", "it already took a hit from my keys and the screen underneath is perfect"],
        ["dust got trapped under it no matter what I did", "it cracked the first week", "fingerprint unlock stopped working reliably", "the edges lift and collect dirt"],
    ),
    "earbuds": (
        ["Headphones & Earbuds"],
        ["{brand} Wireless Earbuds with Charging Case", "{brand} Noise Cancelling Bluetooth Earbuds", "{brand} Open-Ear Sport Headphones"],
        ["Bluetooth 5.3", "30 hours total playtime", "IPX5 sweat resistant"],
        ["pairing took two seconds", "the bass is surprisingly good for the price", "they stay in my ears while running", "battery easily lasts my whole work day", "calls sound clear on both ends"],
        ["the left earbud keeps disconnecting", "the case lid feels flimsy", "there's a noticeable delay when watching videos", "they hurt my ears after an hour"],
    ),
    "powerbank": (
        ["Portable Power Banks"],
        ["{brand} 10000mAh Portable Charger", "{brand} 20000mAh Power Bank with USB-C PD", "{brand} Magnetic Wireless Battery Pack"],
        ["High-density cells", "LED charge indicator", "Airline safe"],
        ["it charged my phone almost three times on a camping trip", "the magnets hold on tight", "it's slim enough for a jeans pocket", "recharges itself overnight"],
        ["it takes forever to recharge", "the magnetic one gets hot against the phone", "the indicator lights are wrong half the time", "it's heavier than I expected"],
    ),
    "mount": (
        ["Car Accessories", "Car Cradles & Mounts"],
        ["{brand} Dashboard Phone Mount", "{brand} Air Vent Magnetic Car Mount", "{brand} Windshield Suction Phone Holder"],
        ["One-hand operation", "360 degree rotation", "Works with thick cases"],
        ["it holds the phone steady even on gravel roads", "I can take the phone out with one hand", "the suction cup hasn't moved in months"],
        ["the suction cup fell off in the summer heat", "it droops when the phone is in landscape", "the vent clip broke a slat in my car"],
    ),
    "grip": (
        ["Accessory Kits", "Phone Grips"],
        ["{brand} Phone Grip and Stand", "{brand} Finger Ring Holder, 2 Pack", "{brand} Silicone Phone Wallet Stick-On"],
        ["Strong 3M adhesive", "Doubles as a kickstand", "Holds 3 cards"],
        ["it makes one-handed texting so much easier", "works great as a stand for videos", "holds my ID and two cards"],
        ["the adhesive gave up after a few weeks", "it blocks wireless charging", "cards slide out when I pull the phone out"],
    ),
}
BRANDS = ["Ailun", "Spigen", "Anker", "OtterBox", "JETech", "Belkin", "ESR", "UGREEN", "Miracase", "Soundcore", "TORRAS", "iOttie", "PopSockets", "Syncwire", "Lamicall"]
OPENERS = {
    5: ["Love it!", "Exactly what I needed.", "Great value.", "Highly recommend.", "Five stars, no complaints."],
    4: ["Pretty good overall.", "Solid product.", "Does the job.", "Happy with it, mostly."],
    3: ["It's okay.", "Mixed feelings.", "Average.", "Works, but not great."],
    2: ["Disappointed.", "Not what I expected.", "Wouldn't buy again."],
    1: ["Don't waste your money.", "Junk.", "Stopped working fast.", "Returned it."],
}
TITLES = {
    5: ["Perfect", "Works great", "Best purchase this year", "Exactly as described", "Love it 😍"],
    4: ["Good for the price", "Nice, one small issue", "Solid", "Would buy again"],
    3: ["Meh", "It's fine", "OK but not amazing", "Decent"],
    2: ["Not great", "Meh… expected better", "Cheaply made"],
    1: ["Broke in a week", "Terrible", "Do not buy", "Garbage 👎"],
}
EXTRAS = [
    "Bought it for my daughter and she uses it every day.",
    "Shipping was fast and the packaging was neat.",
    "For reference I have a Galaxy S23 with a thin case.",
    "Update after three months: still going strong.",
    "Customer service replaced it without any questions.",
    "The color is a bit different from the pictures.",
    "Ordered a second one for my husband's car.",
    "買ってよかったです。Good quality for the price.",
    "Très bon produit, je recommande.",
    "Worth every penny 💯",
]


def products(rng: random.Random) -> list[dict]:
    out = []
    kinds = list(KINDS)
    for p in range(40):
        kind = kinds[p % len(kinds)]
        cats, names, features, _, _ = KINDS[kind]
        brand = BRANDS[(p * 7) % len(BRANDS)]
        price = round(rng.uniform(6, 60), 2)
        # Real meta prices are messy: numbers, null, "None", "$12.99", "—".
        price_field = [price, price, price, None, "None", f"${price}", "—"][p % 7]
        out.append({
            "main_category": CATEGORY if p % 9 else "All Electronics",
            "title": rng.choice(names).format(brand=brand),
            "average_rating": round(rng.uniform(3.2, 4.8), 1),
            "rating_number": rng.randint(3, 25000),
            "features": rng.sample(features, 2),
            "description": [f"The {brand} {kind} is designed for everyday use."] if p % 3 else [],
            "price": price_field,
            "images": [],
            "videos": [],
            "store": brand,
            "categories": [CATEGORY, *cats],
            "details": {"Brand": brand, "Color": rng.choice(["Black", "Clear", "Blue", "White", "Pink"])},
            "parent_asin": f"B0{p:02d}{rng.randrange(16**6):06X}",
            "bought_together": None,
            "_kind": kind,
        })
    return out


def user_id(rng: random.Random) -> str:
    return "A" + "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567") for _ in range(27))


def review(rng: random.Random, prod: dict, ts: int) -> dict:
    _, _, _, goods, bads = KINDS[prod["_kind"]]
    rating = rng.choices([5, 4, 3, 2, 1], [45, 22, 12, 8, 13])[0]
    points = rng.sample(goods, 2) if rating >= 4 else [rng.choice(goods), rng.choice(bads)] if rating == 3 else rng.sample(bads, 2)
    sentences = [rng.choice(OPENERS[rating]), points[0][0].upper() + points[0][1:] + ".", "Also, " + points[1] + "."]
    if rng.random() < 0.4:
        sentences.append(rng.choice(EXTRAS))
    joiner = "<br /><br />" if rng.random() < 0.25 else " "
    return {
        "rating": float(rating),
        "title": rng.choice(TITLES[rating]),
        "text": joiner.join(sentences),
        "images": [],
        "asin": prod["parent_asin"][:-1] + rng.choice("0123456789"),
        "parent_asin": prod["parent_asin"],
        "user_id": user_id(rng),
        "timestamp": ts,
        "helpful_vote": rng.choices([0, 1, 2, 5, 17], [60, 20, 10, 7, 3])[0],
        "verified_purchase": rng.random() < 0.85,
    }


def dumps(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False)


def write_faults(path: Path, prod: dict, rng: random.Random) -> None:
    base = review(rng, prod, 1_650_000_000_000)
    dup = dict(base, text="Same user, product and time as line 2: the writer keeps this one (last wins).")
    lines = [
        b"\xef\xbb\xbf" + dumps(dict(review(rng, prod, 1_649_999_999_999), title="BOM before this line")).encode(),  # 1
        dumps(base).encode(),  # 2
        b"",  # 3
        b"   \t ",  # 4
        b'{"rating": 5.0, "title": "Cut off", "text": "no closing brace"',  # 5
        b"[1, 2, 3]",  # 6
        b'"just a string"',  # 7
        dumps({k: v for k, v in base.items() if k != "user_id"}).encode(),  # 8
        dumps(dict(review(rng, prod, 1_650_000_000_001), rating="five")).encode(),  # 9
        json.dumps(dict(review(rng, prod, 1_650_000_000_002), text="NUL here ->\u0000<- is removed")).encode(),  # 10
        dumps(dict(review(rng, prod, 1_650_000_000_003), text=("This case is great. " * 1000)[:20000])).encode(),  # 11
        dumps(dict(review(rng, prod, 1_650_000_000_004), title="最高 👍", text="手機殼很好用 📱✨ — très bien, ça marche")).encode(),  # 12
        dumps(dup).encode(),  # 13
        dumps(dict(review(rng, prod, 1_650_000_000_005), text="bad byte -> X <-")).encode().replace(b"X", b"\xff"),  # 14
        dumps(dict(review(rng, prod, 1_650_000_000_006), title="", text="  ")).encode(),  # 15
        dumps(dict(review(rng, prod, 1_650_000_000_007), rating="4.0", verified_purchase="true", helpful_vote="3", timestamp="2022-04-15T08:00:00Z")).encode(),  # 16
        dumps(dict(review(rng, prod, 1_650_000_000_008), text="lone surrogate ->\\ud83d<- becomes U+FFFD")).encode().replace(b"\\\\ud83d", b"\\ud83d"),  # 17
        dumps(dict(review(rng, prod, 1_650_000_000_009), color="Midnight Blue")).encode(),  # 18 (no final newline)
    ]
    path.write_bytes(b"\r\n".join(lines))


def main() -> None:
    rng = random.Random(2023)
    prods = products(rng)
    ts = 1_609_459_200_000  # 2021-01-01
    reviews = []
    for _ in range(200):
        ts += rng.randint(3_600_000, 400_000_000)
        reviews.append(review(rng, rng.choice(prods), ts))
    (HERE / "Cell_Phones_and_Accessories.jsonl").write_text("".join(dumps(r) + "\n" for r in reviews), encoding="utf-8")
    meta = [{k: v for k, v in p.items() if k != "_kind"} for p in prods]
    (HERE / "meta_Cell_Phones_and_Accessories.jsonl").write_text("".join(dumps(m) + "\n" for m in meta), encoding="utf-8")
    write_faults(HERE / "faults.jsonl", prods[0], rng)


if __name__ == "__main__":
    main()
