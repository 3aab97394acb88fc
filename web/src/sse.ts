/**
 * An incremental parser for `text/event-stream` bodies (the WHATWG server-sent events format).
 *
 * Feed it the body's bytes in whatever pieces the network delivers: an event, a line, a "\r\n"
 * pair or a multi-byte UTF-8 character may be split across chunks, and the events come out the
 * same as if the body had arrived in one piece.
 */

/** A dispatched event; `data` joins the event's `data:` lines with "\n". */
export interface SSEEvent {
  readonly kind: "event";
  readonly event: string;
  readonly data: string;
  readonly id: string | null;
}

/** A comment line (`: ping`): carries no data, but shows the connection is alive. */
export interface SSEComment {
  readonly kind: "comment";
  readonly text: string;
}

export type SSEMessage = SSEEvent | SSEComment;

const LINE_BREAK = /\r\n|\r|\n/;

export class SSEParser {
  // `stream: true` keeps a partial UTF-8 sequence until the next chunk completes it.
  private readonly decoder = new TextDecoder("utf-8");
  private partialLine = "";
  // A chunk ended in "\r": a "\n" opening the next chunk is the rest of that line break.
  private endedWithCR = false;
  private dataLines: string[] = [];
  private eventType = "";
  private lastEventId: string | null = null;

  /** The messages completed by `chunk`, in order. */
  push(chunk: Uint8Array): SSEMessage[] {
    return this.feed(this.decoder.decode(chunk, { stream: true }));
  }

  /**
   * Flush at the end of the body. Per the specification an event without its closing blank line
   * is dropped, so a truncated stream never yields a half-received event.
   */
  end(): SSEMessage[] {
    const messages = this.feed(this.decoder.decode());
    this.partialLine = "";
    this.dataLines = [];
    this.eventType = "";
    return messages;
  }

  private feed(text: string): SSEMessage[] {
    if (this.endedWithCR && text.length > 0) {
      this.endedWithCR = false;
      if (text.startsWith("\n")) {
        text = text.slice(1);
      }
    }
    if (text.endsWith("\r")) {
      this.endedWithCR = true;
    }
    const lines = (this.partialLine + text).split(LINE_BREAK);
    this.partialLine = lines.pop() ?? "";
    const messages: SSEMessage[] = [];
    for (const line of lines) {
      const message = this.processLine(line);
      if (message !== null) {
        messages.push(message);
      }
    }
    return messages;
  }

  private processLine(line: string): SSEMessage | null {
    if (line === "") {
      return this.dispatch();
    }
    if (line.startsWith(":")) {
      return { kind: "comment", text: withoutLeadingSpace(line.slice(1)) };
    }
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    const value = colon === -1 ? "" : withoutLeadingSpace(line.slice(colon + 1));
    if (field === "data") {
      this.dataLines.push(value);
    } else if (field === "event") {
      this.eventType = value;
    } else if (field === "id" && !value.includes("\0")) {
      this.lastEventId = value;
    }
    // `retry:` and unknown fields are ignored: reconnection is the caller's retry policy.
    return null;
  }

  private dispatch(): SSEEvent | null {
    const dataLines = this.dataLines;
    const eventType = this.eventType;
    this.dataLines = [];
    this.eventType = "";
    if (dataLines.length === 0) {
      return null;
    }
    return { kind: "event", event: eventType || "message", data: dataLines.join("\n"), id: this.lastEventId };
  }
}

function withoutLeadingSpace(value: string): string {
  return value.startsWith(" ") ? value.slice(1) : value;
}
